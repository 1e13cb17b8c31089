"""JAX-side probes: run inside the sandboxed child, reach the candidate only through its public names."""
