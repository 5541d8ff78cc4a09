# The same static binary as ./build.sh, built on Debian 12, in two images:
#   docker build --target cpu -t coli .      only the binary (FROM scratch): CPU-only anywhere
#   docker build --target gpu -t coli-gpu .  the binary beside glibc's loader, which NVIDIA's
#                                            driver libraries need (the container toolkit mounts
#                                            those, not glibc)
#   docker run --rm -v /models:/models coli run -m /models/M.gguf -p Hi
#   docker run --rm --gpus all -v /models:/models coli-gpu run -m /models/M.gguf -p Hi
# tests/test_cuda.sh builds both roots without Docker and runs a golden model in each.
FROM debian:12 AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc libc6-dev musl-tools && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY build.sh coli.c kernels.cu kernels.ptx ./
COPY vendor vendor
RUN ./build.sh && ./coli --version

FROM debian:12-slim AS gpu
COPY --from=build /src/coli /coli
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
ENTRYPOINT ["/coli"]

FROM scratch AS cpu
COPY --from=build /src/coli /coli
ENTRYPOINT ["/coli"]
