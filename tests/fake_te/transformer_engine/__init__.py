"""A stand-in for Transformer Engine (tests/fake_te/README.md): not TE, computes in high precision."""
FAKE = True
