"""Teaching code, not on the training path: collectives built from send/recv, benchmarked
against torch.distributed's own in bench/collectives.py."""
