"""Starting runs: the torchrun launcher, checks before start, stop signals and the dump-folder lock."""
