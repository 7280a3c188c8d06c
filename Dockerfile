# syntax=docker/dockerfile:1
# kerf's image: both binaries, kerf-controller and kerf-kubelet-plugin, on a distroless base,
# plus a mock driver root of fake GPU tools for the kubelet plugin's mock mode.
#
#   docker build -t kerf:dev .
#
# Without a registry, .ci/image builds the same binaries on the host and an image FROM scratch
# with podman (Containerfile.local), for mock mode.
#
# The runtime base has glibc (not static): the kubelet plugin loads libnvidia-ml.so.1 with
# dlopen at run time, and NVIDIA's libraries are built against glibc. It runs as the
# unprivileged user 65532 by default; the kubelet plugin's DaemonSet runs it as root.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep the registry and the target directory between builds; the binaries
# are copied out of the target cache because it is not part of the image. The release
# profile strips their debug info (Cargo.toml): 24-29 MB each rather than 115-165 MB.
# The mock driver root's tools are symlinks to the one kerf-fake-gpu-tools binary, which acts
# as the tool it is run as (the name in argv[0], which the kubelet plugin passes as the
# symlink's path); the distroless stage has no shell to make them, so they are made here,
# pointing at where the binary lands in that stage.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
        -p kerf-controller -p kerf-kubelet-plugin -p kerf-fake-gpu-tools \
    && mkdir -p /out/mock-driver/usr/bin \
    && cp target/release/kerf-controller target/release/kerf-kubelet-plugin \
        target/release/kerf-fake-gpu-tools /out/ \
    && ln -s /usr/local/bin/kerf-fake-gpu-tools /out/mock-driver/usr/bin/nvidia-smi \
    && ln -s /usr/local/bin/kerf-fake-gpu-tools /out/mock-driver/usr/bin/nvidia-cuda-mps-control

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/kerf-controller /out/kerf-kubelet-plugin /out/kerf-fake-gpu-tools \
    /usr/local/bin/
# A mock driver root for mock mode only (the chart's gpus.source=mock passes
# --mock-driver-root=/opt/kerf/mock-driver): fake nvidia-smi and nvidia-cuda-mps-control, so
# that MPS sharing runs its daemons and compute-mode calls without a GPU. Nothing uses it with
# real GPUs: there the plugin runs the driver's own tools from --driver-root. The fakes'
# call log under it is not written (the plugin's root filesystem is read-only); they work
# without it.
COPY --from=build /out/mock-driver /opt/kerf/mock-driver
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kerf-controller"]
