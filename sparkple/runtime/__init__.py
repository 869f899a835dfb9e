"""The PLE runtime inside the serving process: the published table mapped and prefetched, the
n-gram row ids, the gather and the NVFP4 decode, the host step's handshake with the GPU step,
and the counters the host's metrics exporter reads.

Importing this package imports nothing: the host programs (sparkple.metrics) read the stats and the
table's metadata with the standard library only.
"""
