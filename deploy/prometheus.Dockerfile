# Prometheus from Debian's package, for machines that cannot pull prom/prometheus:
#
#   docker build -f deploy/prometheus.Dockerfile -t lattica-prometheus deploy
#   PROMETHEUS_IMAGE=lattica-prometheus docker compose -f deploy/docker-compose.yml up -d
#
# The compose file runs `prometheus` with its own flags, as with the upstream image.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090/tcp
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
