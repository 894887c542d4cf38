"""Benchmarks with vLLM's flags, tables and JSON keys: ``fastdeploy bench serve|latency|throughput``."""
