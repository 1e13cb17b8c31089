# The verifier's own container (task.toml: environment_mode "separate"): torch-free, offline once built, every
# package from verifier.lock. bubblewrap seals each run of the candidate (grader/isolation/sandbox.py); the tests
# are bundled in the image (/tests), never uploaded.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/verifier
COPY verifier.lock /opt/verifier.lock
RUN /opt/verifier/bin/pip install --no-cache-dir --require-hashes -r /opt/verifier.lock
COPY . /tests/
WORKDIR /tests
