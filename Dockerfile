# The same static binary as ./build.sh, built on Debian 12; the final image holds only it.
#   docker build -t coli . && docker run --rm -v /models:/models coli run -m /models/M.gguf -p Hi
FROM debian:12 AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc libc6-dev musl-tools && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY build.sh coli.c kernels.cu kernels.ptx ./
COPY vendor vendor
RUN ./build.sh && ./coli --version

FROM scratch
COPY --from=build /src/coli /coli
ENTRYPOINT ["/coli"]
