# syntax=docker/dockerfile:1
# kerf's image: both binaries, kerf-controller and kerf-kubelet-plugin, on a distroless base.
#
#   docker build -t kerf:dev .
#
# The runtime base has glibc (not static): the kubelet plugin loads libnvidia-ml.so.1 with
# dlopen at run time, and NVIDIA's libraries are built against glibc. It runs as the
# unprivileged user 65532 by default; the kubelet plugin's DaemonSet runs it as root.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep the registry and the target directory between builds; the binaries
# are copied out of the target cache because it is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kerf-controller -p kerf-kubelet-plugin \
    && mkdir -p /out \
    && cp target/release/kerf-controller target/release/kerf-kubelet-plugin /out/

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/kerf-controller /out/kerf-kubelet-plugin /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kerf-controller"]
