"""Tests of engine/posttrain."""
