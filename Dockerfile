# Slim, non-root image for the gateway and the simulated fleet (same image, different command).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY engine_adapters engine_adapters
COPY policies policies
COPY simulator simulator
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 fleetgate
COPY --from=build /install /usr/local
USER fleetgate
WORKDIR /home/fleetgate
EXPOSE 8000
ENTRYPOINT ["fleetgate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
