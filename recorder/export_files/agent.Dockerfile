# The agent's environment: the torch sources and their JAX twin side by side, every package from agent.lock
# (exact versions and hashes, resolved as of its lock-date; torch 2.13.0 is PyPI's CUDA build on Linux).
FROM python:3.11-slim
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/workspace/torch_orig
COPY agent.lock /opt/agent.lock
RUN pip install --no-cache-dir --require-hashes -r /opt/agent.lock
COPY workspace/ /workspace/
WORKDIR /workspace
