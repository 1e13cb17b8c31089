"""Hydra app that runs a pure-PyTorch source in true fp32 and writes references/<task>.h5."""
