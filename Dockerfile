# tandem serve in a container. An example: there is no container registry or cluster where this was
# written, so it is untested here (see README "Serving" and docs/serve.md).
#
#   docker build -t tandem .
#   docker run --rm -p 8080:8080 tandem                                   # the shipped pair
#   docker run --rm -p 8080:8080 -v /models/gemma-4-e2b:/model:ro -v /models/e2b-assistant:/assistant:ro \
#       tandem serve --host 0.0.0.0 --model /model --assistant /assistant
#
# The build is for the CPU it runs on at run time: tandem picks AVX-512 / AVX2 / scalar kernels when it
# starts, so one image runs on any x86-64 machine.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY examples ./examples
COPY models ./models
RUN cargo build --release --locked --bin tandem

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 tandem
COPY --from=build /src/target/release/tandem /usr/local/bin/tandem
# The shipped pair, for `tandem serve` without --model: the binary looks for models/default under the
# source directory it was built in (/src).
COPY --from=build /src/models /src/models
USER tandem
EXPOSE 8080
# Readiness: GET /health is 503 while the model loads and while shutting down, 200 when ready (probe it
# from the orchestrator, e.g. deploy/kubernetes.yaml; this slim image has no HTTP client of its own).
ENTRYPOINT ["/usr/local/bin/tandem"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
