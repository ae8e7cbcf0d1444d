"""Generated protobuf and gRPC code for protos/libs/pb/*.proto (``make protos``; committed, checked by ``make check-protos``). Every layer may import it."""
