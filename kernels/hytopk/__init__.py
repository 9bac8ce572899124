"""HyTopK: exact top-k of the lightning-indexer scores, never writing the score table."""
