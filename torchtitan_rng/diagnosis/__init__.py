"""Finding why two runs differ: per-step stream fingerprints, divergence diagnosis, loss plots."""
