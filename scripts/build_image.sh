#!/usr/bin/env bash
# Builds the CPU container image (deploy/docker/Dockerfile) with podman, tagged with the project version.
#
#   scripts/build_image.sh                       # offline: a local Debian base made with debootstrap
#   BASE_IMAGE=python:3.11-slim scripts/build_image.sh   # any base with python3 >= 3.10 (+ venv)
#
# Environment (all optional):
#   IMAGE            repository to tag (default localhost/pdserve); tags :VERSION and :latest
#   BASE_IMAGE       base for the Dockerfile (default localhost/pdserve-base:bookworm, made here once
#                    with debootstrap and reused while it exists; `podman rmi` it to rebuild)
#   TORCH_SPEC       what pip installs for torch (default: the CPU wheel in TORCH_WHEEL_DIR if one is
#                    there, else torch==2.13.0 from TORCH_INDEX_URL)
#   TORCH_INDEX_URL  index for TORCH_SPEC (default: the PyTorch CPU index; empty for a local wheel, so
#                    torch's own dependencies come from pip's default index)
#   TORCH_WHEEL_DIR  folder with a local torch CPU wheel, mounted read-only at /wheels during the build
#                    (default /opt/wheels)
#   DEBIAN_MIRROR    mirror for debootstrap (default: the first deb URI of this host's apt sources)
#
# Why these podman flags: crun refuses the cgroups of the sandboxes this project is developed in, so
# every RUN step uses runc, with explicit ulimits (without them runc fails here: "error setting rlimit
# type 7: operation not permitted"); --network host lets pip in the RUN steps use the host's network
# as it is, so the build does not depend on a container network being set up.
set -Eeuo pipefail  # -E: the ERR trap below also fires inside functions
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/pdserve}
BASE_IMAGE=${BASE_IMAGE:-localhost/pdserve-base:bookworm}
TORCH_WHEEL_DIR=${TORCH_WHEEL_DIR:-/opt/wheels}
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)
PODMAN_RUN_FLAGS=(--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=4096:4096)

log() { echo "build_image: $*" >&2; }
trap 'log "failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR  # never fail silently under set -e
[ -n "$VERSION" ] || { log "no version in pyproject.toml"; exit 1; }
command -v podman >/dev/null || { log "podman is not installed (scripts/install_ops_tools.sh installs it)"; exit 1; }

# The local base stands in for Docker Hub's python:3.11-slim where no registry but Debian's is reachable:
# Debian bookworm's python3 is 3.11 too, so the same cp311 torch wheel fits both.
make_local_base() {
    command -v debootstrap >/dev/null || { log "debootstrap is not installed"; exit 1; }
    [ "$(id -u)" -eq 0 ] || { log "debootstrap needs root"; exit 1; }
    local mirror=${DEBIAN_MIRROR:-}
    if [ -z "$mirror" ]; then  # the mirror this host's apt already uses (reachable from here)
        mirror=$(grep -hs -m1 -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
                 | head -n1 | awk '$1 == "URIs:" {print $2} $1 == "deb" {print ($2 ~ /^\[/ ? $3 : $2)}' || true)
    fi
    root=$(mktemp -d /var/tmp/pdserve-base.XXXXXX)
    trap 'rm -rf "$root"' EXIT  # a global: the trap runs after this function's locals are gone
    log "debootstrap bookworm into $root (mirror: ${mirror:-debootstrap default})"
    # minbase + python3-venv: what the Dockerfile needs (python3 -m venv); nothing else.
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" ${mirror:+"$mirror"} >&2
    # pip inside the build verifies TLS against the system bundle: give it this host's, which also holds
    # any CA that this network's TLS proxy signs with (a Debian default bundle may not).
    mkdir -p "$root/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >&2
}

if [ "$BASE_IMAGE" = "localhost/pdserve-base:bookworm" ]; then
    if podman image exists "$BASE_IMAGE"; then
        log "reusing $BASE_IMAGE"
    else
        t0=$(date +%s)
        make_local_base
        log "made $BASE_IMAGE in $(( $(date +%s) - t0 ))s"
    fi
fi

volumes=()
if [ -z "${TORCH_SPEC:-}" ]; then
    wheel=$(ls "$TORCH_WHEEL_DIR"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)
    if [ -n "$wheel" ]; then
        # A local CPU wheel: no CUDA build can come in, and no 190 MB download.
        TORCH_SPEC="/wheels/$(basename "$wheel")"
        TORCH_INDEX_URL=${TORCH_INDEX_URL-}
        volumes=(--volume "$TORCH_WHEEL_DIR:/wheels:ro")
    fi
fi
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "PDSERVE_VERSION=$VERSION")
[ -n "${TORCH_SPEC:-}" ] && build_args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC")
[ -n "${TORCH_INDEX_URL+set}" ] && build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

t0=$(date +%s)
log "building $IMAGE:$VERSION from $BASE_IMAGE (torch: ${TORCH_SPEC:-Dockerfile default})"
podman build --network host "${PODMAN_RUN_FLAGS[@]}" "${volumes[@]}" "${build_args[@]}" \
    -f deploy/docker/Dockerfile -t "$IMAGE:$VERSION" -t "$IMAGE:latest" . >&2
log "built $IMAGE:$VERSION in $(( $(date +%s) - t0 ))s"
echo "$IMAGE:$VERSION"
