# syntax=docker/dockerfile:1
#
# c10m-operator image: a static (musl) binary on distroless/static, non-root.
# Build from the workspace root:
#
#   docker build -f server-image/operator.Dockerfile -t c10m/operator:0.1.0 .

ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS builder
RUN rustup target add x86_64-unknown-linux-musl && apt-get update && apt-get install -y --no-install-recommends musl-tools && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p c10m-operator --target x86_64-unknown-linux-musl \
 && install -D -m 0755 target/x86_64-unknown-linux-musl/release/c10m-operator /out/c10m-operator

# No shell, no libc; runs as uid/gid 65532 (the chart's securityContext too).
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=builder /out/c10m-operator /usr/local/bin/c10m-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/c10m-operator"]
CMD ["run"]
