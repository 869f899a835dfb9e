"""sparkple: serve Qwen3.8-Flash-Next on DGX Spark with the PLE table on NVMe."""

__version__ = "0.1.0"
