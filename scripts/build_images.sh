#!/usr/bin/env bash
# Build pdserve's CPU image (deploy/Dockerfile.cpu) with the engine this machine has.
#
#   scripts/build_images.sh              # -> localhost/pdserve:cpu
#
# Environment:
#   IMAGE         the tag (default localhost/pdserve:cpu)
#   ENGINE        docker, podman or buildah (default: the first usable, in that order)
#   PYTHON_IMAGE  the base image; unset: localhost/pdserve-base:bookworm, made by
#                 scripts/base_image.sh when the engine does not have it yet
#   TORCH_INDEX   PyTorch's CPU wheel index, for machines that reach it; unset: the
#                 torch==2.13.0+cpu wheel this machine's pip finds is put in
#                 deploy/wheels/ and the build uses no extra index
#   PREPARE_MODEL 1 (default): bake the default model into the image; 0: none
#   PIP_CA        a CA bundle the build's pip trusts, for networks that re-sign TLS
#                 (default: the `cert` this machine's pip uses, if any)
#   BUILD_ARGS    more arguments for the engine's build command
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
image=${IMAGE:-localhost/pdserve:cpu}
engine=${ENGINE:-$(scripts/container_engine.sh)}
export ENGINE=$engine

have_image() {
    case "$engine" in
        docker) docker image inspect "$1" >/dev/null 2>&1 ;;
        podman) podman image exists "$1" ;;
        buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
    esac
}

if [ -z "${PYTHON_IMAGE:-}" ]; then
    PYTHON_IMAGE=localhost/pdserve-base:bookworm
    if ! have_image "$PYTHON_IMAGE"; then
        echo "making the base image $PYTHON_IMAGE (mmdebstrap, Debian bookworm)"
        scripts/base_image.sh "$PYTHON_IMAGE"
    fi
fi

pip=(python3 -m pip)
[ -x .venv/bin/pip ] && pip=(.venv/bin/pip)
args=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --build-arg "PREPARE_MODEL=${PREPARE_MODEL:-1}")
if [ -n "${TORCH_INDEX:-}" ]; then
    args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
else
    # The exact pin from the lock, fetched by this machine's pip (its own find-links and
    # indexes, e.g. a local wheel folder) into the folder the build mounts.
    torch_pin=$(grep -E '^torch==' requirements/cpu.lock | head -n 1)
    if ! ls deploy/wheels/torch-"${torch_pin#torch==}"-*.whl >/dev/null 2>&1; then
        "${pip[@]}" download --quiet --no-deps --only-binary :all: --python-version 3.11 \
            --platform manylinux_2_28_x86_64 -d deploy/wheels "$torch_pin" || {
            echo "build_images.sh: pip finds no $torch_pin wheel here; set" \
                 "TORCH_INDEX=https://download.pytorch.org/whl/cpu (or put the wheel in" \
                 "deploy/wheels/)" >&2
            exit 1
        }
    fi
    args+=(--build-arg "TORCH_INDEX=")
fi

# The CA bundle this machine's pip trusts (PIP_CERT or pip's `cert` setting) goes to the
# build as the pip_ca secret: where TLS to PyPI is re-signed, the image's own bundle fails.
pip_ca=${PIP_CA:-${PIP_CERT:-$("${pip[@]}" config get global.cert 2>/dev/null || true)}}
if [ -n "$pip_ca" ] && [ -s "$pip_ca" ]; then
    args+=(--secret "id=pip_ca,src=$pip_ca")
fi

# BuildKit reads deploy/Dockerfile.cpu.dockerignore by itself; podman and buildah are
# told (without it the context would be the whole checkout, virtual envs included).
# chroot isolation: builds need no runtime (which containers inside containers may lack).
case "$engine" in
    docker) cmd=(env DOCKER_BUILDKIT=1 docker build) ;;
    podman) cmd=(podman build --isolation chroot --ignorefile deploy/Dockerfile.cpu.dockerignore) ;;
    buildah) cmd=(buildah bud --isolation chroot --ignorefile deploy/Dockerfile.cpu.dockerignore) ;;
esac
# shellcheck disable=SC2086  # BUILD_ARGS is a list of words by design
nice -n 10 "${cmd[@]}" "${args[@]}" ${BUILD_ARGS:-} -f deploy/Dockerfile.cpu -t "$image" .
echo "built $image with $engine on $PYTHON_IMAGE"
