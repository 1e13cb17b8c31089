#!/bin/bash
# Harbor's oracle run: the reference JAX solution, put where the agent's tree goes.
set -euo pipefail
mkdir -p /workspace/jax_repo
cp -r "$(dirname "$0")/jax_repo/." /workspace/jax_repo/
