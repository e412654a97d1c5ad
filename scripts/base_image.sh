#!/usr/bin/env bash
# Make the base image deploy/Dockerfile.cpu builds on where no registry is reachable:
# Debian bookworm (whose python3 is 3.11, as the lock needs) with python3.11 and venv,
# made from Debian's own archive with mmdebstrap and imported into the local engine.
#
#   scripts/base_image.sh [IMAGE]        # default localhost/pdserve-base:bookworm
#
# Environment: ENGINE (docker, podman or buildah; detected when unset), MIRROR (the
# Debian archive; default http://deb.debian.org/debian). Needs root (mmdebstrap's root
# mode) or a working unshare mode.
set -euo pipefail

image=${1:-localhost/pdserve-base:bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
here=$(cd "$(dirname "$0")" && pwd)
engine=${ENGINE:-$("$here/container_engine.sh")}

command -v mmdebstrap >/dev/null || {
    echo "base_image.sh: mmdebstrap is missing: apt-get install mmdebstrap" >&2
    exit 1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# apt variant: Essential packages and apt (the Dockerfile's apt-get installs the rest).
# Documentation, man pages and translations are left out, now and in every later apt
# install in images built on this one (the dpkg options stay in /etc/dpkg/dpkg.cfg.d).
# python-is-python3: the Dockerfile calls `python`, as on the python:3.11 images; passwd:
# its useradd. (A package's install starts no service in a build: with no init system,
# invoke-rc.d blocks it.)
nice -n 10 mmdebstrap --variant=apt --format=tar \
    --include=ca-certificates,passwd,python3.11,python3.11-venv,python-is-python3 \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$work/rootfs.tar" \
    "deb $mirror bookworm main" \
    "deb $mirror bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"

changes=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
         --change 'ENV LANG=C.UTF-8'
         --change 'CMD ["python3"]')
case "$engine" in
    docker|podman) "$engine" import "${changes[@]}" "$work/rootfs.tar" "$image" >/dev/null ;;
    buildah)
        ctr=$(buildah from scratch)
        buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
        buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --env LANG=C.UTF-8 --cmd python3 "$ctr"
        buildah commit --rm "$ctr" "$image" >/dev/null ;;
    *) echo "base_image.sh: unknown engine '$engine'" >&2; exit 1 ;;
esac
echo "$image"
