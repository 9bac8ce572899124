"""Kept for bench/topk.py: the checkout shim lives in bench/_repo.py."""

from _repo import ROOT, setup  # noqa: F401
