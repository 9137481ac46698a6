# Generated code lives beside this file (kvd_pb2*.py); regenerate with `make proto`.
