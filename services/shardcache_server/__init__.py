"""shardcache_server: the cluster side of shardcache."""
