{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "shardcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "shardcache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "shardcache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; pass (dict "ctx" $ "component" "x"). */}}
{{- define "shardcache.labels" -}}
helm.sh/chart: {{ include "shardcache.chart" .ctx }}
{{ include "shardcache.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* Selector labels: name + instance + component only (selectors are immutable). */}}
{{- define "shardcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardcache.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "shardcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shardcache.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "shardcache.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "shardcache.redisSecretName" -}}
{{- if .Values.redis.enabled }}
{{- default (printf "%s-redis" (include "shardcache.fullname" .)) .Values.redis.auth.existingSecret }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "shardcache.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "shardcache.fullname" .)) .Values.ray.auth.existingSecret }}
{{- end }}

{{- define "shardcache.headHost" -}}
{{ include "shardcache.fullname" . }}-ray-head
{{- end }}

{{/* Environment every cache process shares: SHARDCACHE_* settings, Redis URL, Ray token. */}}
{{- define "shardcache.env" -}}
- name: SHARDCACHE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "shardcache.redisSecretName" . }}
      key: {{ if .Values.redis.enabled }}redis-password{{ else }}redis-url{{ end }}
{{- if .Values.redis.enabled }}
- name: SHARDCACHE_REDIS_URL
  value: "redis://:$(SHARDCACHE_REDIS_PASSWORD)@{{ include "shardcache.fullname" . }}-redis:6379/0"
{{- else }}
- name: SHARDCACHE_REDIS_URL
  value: "$(SHARDCACHE_REDIS_PASSWORD)"
{{- end }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "shardcache.rayTokenSecretName" . }}
      key: token
{{- if .Values.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom: {secretKeyRef: {name: {{ .Values.s3.existingSecret }}, key: AWS_ACCESS_KEY_ID}}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom: {secretKeyRef: {name: {{ .Values.s3.existingSecret }}, key: AWS_SECRET_ACCESS_KEY}}
{{- end }}
{{- end }}

{{/* Validate values that the schema cannot express; collect messages, fail once. */}}
{{- define "shardcache.validateValues" -}}
{{- $messages := list }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.existingSecret) }}
{{- $messages = append $messages "redis: set redis.enabled=true or redis.external.existingSecret (a Secret with key redis-url)." }}
{{- end }}
{{- if gt (int64 .Values.cache.cacheBytes) (int64 .Values.ray.objectStoreBytes) }}
{{- $messages = append $messages "cache.cacheBytes must not exceed ray.objectStoreBytes: the store budget lives in the object store." }}
{{- end }}
{{- with .Values.examples.rayJob }}
{{- if and .enabled (not $.Values.kuberay.enabled) }}
{{- $messages = append $messages "examples.rayJob.enabled needs kuberay.enabled=true: the RayJob selects the chart's RayCluster by name." }}
{{- end }}
{{- if and .enabled (not $.Values.ray.head.jobSubmission) }}
{{- $messages = append $messages "examples.rayJob.enabled needs ray.head.jobSubmission=true: a RayJob is submitted through the head's Jobs API (port 8265)." }}
{{- end }}
{{- if and .enabled (not .url) }}
{{- $messages = append $messages "examples.rayJob.url: set the dataset URL the example trains on, e.g. s3://bucket/train/." }}
{{- end }}
{{- end }}
{{- if and .Values.endpoint.enabled .Values.kuberay.enabled }}
{{- $messages = append $messages "endpoint.enabled needs kuberay.enabled=false: the endpoint runs in the chart's cache worker DaemonSet." }}
{{- end }}
{{- if and .Values.endpoint.flight.enabled (not .Values.endpoint.enabled) }}
{{- $messages = append $messages "endpoint.flight.enabled needs endpoint.enabled=true: Flight is served by the node-local endpoint." }}
{{- end }}
{{- with .Values.examples.pyTorchJob }}
{{- if and .enabled (not $.Values.endpoint.enabled) }}
{{- $messages = append $messages "examples.pyTorchJob.enabled needs endpoint.enabled=true: its pods read through the node-local endpoint." }}
{{- end }}
{{- if and .enabled (not .url) }}
{{- $messages = append $messages "examples.pyTorchJob.url: set the dataset URL the example trains on, e.g. s3://bucket/train/." }}
{{- end }}
{{- end }}
{{- if $messages }}
{{- fail (printf "\nVALUES VALIDATION:\n%s" (join "\n" $messages)) }}
{{- end }}
{{- end }}

{{/*
A private CA for an external rediss:// Redis: mounted read-only where every
process that talks to Redis can read it; the URL names it with
?ssl_ca_certs=/etc/shardcache/redis-ca/ca.crt (redis-py's URL option).
*/}}
{{- define "shardcache.redisCaMount" -}}
{{- if .Values.redis.external.caSecret }}
- {name: redis-ca, mountPath: /etc/shardcache/redis-ca, readOnly: true}
{{- end }}
{{- end }}

{{- define "shardcache.redisCaVolume" -}}
{{- if .Values.redis.external.caSecret }}
- name: redis-ca
  secret: {secretName: {{ .Values.redis.external.caSecret | quote }}, items: [{key: ca.crt, path: ca.crt}]}
{{- end }}
{{- end }}

{{- define "shardcache.flightTokenSecretName" -}}
{{- default (printf "%s-flight-token" (include "shardcache.fullname" .)) .Values.endpoint.flight.tokenSecret }}
{{- end }}

{{- define "shardcache.endpointSocket" -}}
{{ trimSuffix "/" .Values.endpoint.hostPath }}/endpoint.sock
{{- end }}

{{/*
What a training pod outside Ray needs to read through its node's cache
worker (issue 18): the socket's hostPath mounted read-only, where it is
(SHARDCACHE_ENDPOINT), which node the pod is on (downward API), and the
deployment namespace. With Flight, also where to stream from when the node
has no cache worker (allow_remote=True) and the token, from a copy of the
chart's Secret in the training namespace.
*/}}
{{- define "shardcache.trainingPodEnv" -}}
- name: SHARDCACHE_ENDPOINT
  value: {{ include "shardcache.endpointSocket" . | quote }}
- name: SHARDCACHE_NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: SHARDCACHE_NAMESPACE
  value: {{ .Values.cacheNamespace | quote }}
{{- if .Values.endpoint.flight.enabled }}
{{- $tls := ne .Values.endpoint.flight.tlsSecret "" }}
- name: SHARDCACHE_REMOTE_URL
  {{- if .Values.endpoint.flight.streamPort }}
  value: "{{ ternary "tls" "tcp" $tls }}://{{ include "shardcache.fullname" . }}-flight.{{ .Release.Namespace }}.svc:{{ .Values.endpoint.flight.streamPort }}"
  {{- else }}
  value: "{{ ternary "grpc+tls" "grpc" $tls }}://{{ include "shardcache.fullname" . }}-flight.{{ .Release.Namespace }}.svc:{{ .Values.endpoint.flight.port }}"
  {{- end }}
- name: SHARDCACHE_REMOTE_TOKEN
  valueFrom: {secretKeyRef: {name: {{ include "shardcache.flightTokenSecretName" . }}, key: token}}
{{- if .Values.endpoint.flight.tlsSecret }}
- name: SHARDCACHE_REMOTE_CA
  value: /etc/shardcache/flight-ca/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{- define "shardcache.trainingPodMounts" -}}
- {name: shardcache-endpoint, mountPath: {{ .Values.endpoint.hostPath | quote }}, readOnly: true}
{{- if and .Values.endpoint.flight.enabled .Values.endpoint.flight.tlsSecret }}
- {name: shardcache-flight-ca, mountPath: /etc/shardcache/flight-ca, readOnly: true}
{{- end }}
{{- end }}

{{- define "shardcache.trainingPodVolumes" -}}
- name: shardcache-endpoint
  hostPath: {path: {{ .Values.endpoint.hostPath | quote }}, type: DirectoryOrCreate}
{{- if and .Values.endpoint.flight.enabled .Values.endpoint.flight.tlsSecret }}
- name: shardcache-flight-ca
  secret: {secretName: {{ .Values.endpoint.flight.tlsSecret | quote }}, items: [{key: tls.crt, path: ca.crt}]}
{{- end }}
{{- end }}
