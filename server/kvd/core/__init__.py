"""kvd's core: pools, tiers, admission and eviction policies.

Imports neither grpc nor cupy, takes its time from a Clock, and is tested synchronously.
"""
