"""Tessel distributed primitives: mesh, communication (with its byte ledger), TP/SP, PP, DP, CP, EP."""
