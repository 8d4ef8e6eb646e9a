"""Checkpoints: what a run saves, where, how it is loaded safely, and how a run resumes from one."""
