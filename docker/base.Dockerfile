# Local stand-in for the public bases, for machines that cannot reach an image
# registry: a Debian bookworm root file system made with debootstrap (python3.11,
# python3.11-venv, python3-distutils, ca-certificates) and imported as
# ROOTFS_IMAGE, plus what the other Dockerfiles expect of their base: a non-root
# user `ray` with uid 1000 (as in rayproject/ray) and a Python whose `pip` is
# first on PATH.
# scripts/build_images.sh makes the root file system and builds this; it is not
# part of a normal `docker build`.
ARG ROOTFS_IMAGE=localhost/debian-minbase:bookworm
FROM ${ROOTFS_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash ray \
    && python3.11 -m venv /home/ray/venv \
    && chown -R 1000:1000 /home/ray/venv
ENV PATH=/home/ray/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8
WORKDIR /home/ray
USER 1000
CMD ["/bin/bash"]
