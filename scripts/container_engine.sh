#!/usr/bin/env bash
# Print the container engine to build and run pdserve's images with: $ENGINE if set,
# else the first usable of docker (its daemon answers), podman, buildah. Exits 1, saying
# what to install, when none is usable.
set -euo pipefail

usable() {
    case "$1" in
        docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
        podman) command -v podman >/dev/null && podman info >/dev/null 2>&1 ;;
        buildah) command -v buildah >/dev/null && buildah info >/dev/null 2>&1 ;;
        *) return 1 ;;
    esac
}

if [ -n "${ENGINE:-}" ]; then
    usable "$ENGINE" || { echo "container_engine.sh: ENGINE=$ENGINE is not usable here" >&2; exit 1; }
    echo "$ENGINE"
    exit 0
fi
for engine in docker podman buildah; do
    if usable "$engine"; then
        echo "$engine"
        exit 0
    fi
done
echo "no usable container engine: install docker (with a running daemon), podman or" \
     "buildah (Debian: apt-get install podman buildah runc)" >&2
exit 1
