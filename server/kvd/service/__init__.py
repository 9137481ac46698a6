"""The gRPC layer: protobuf in, domain call, protobuf out. Nothing else."""
