"""gRPC server reflection under both of its names: `grpc.reflection.v1alpha` (what grpcio-reflection
serves) and `grpc.reflection.v1` (what newer clients ask for first: grpcurl, Postman, grpcui).

grpcio-reflection ships only v1alpha. The two versions' messages are the same on the wire (v1 is
v1alpha's file under a new package name, every field number and type unchanged), so one servicer
answers both; v1 is registered as a generic handler that uses v1alpha's message classes.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
SERVICE_NAME_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection for `service_names` (reflection's own v1alpha name is added) on `server`."""
    servicer = ReflectionServicer((*service_names, SERVICE_NAME))
    reflection_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb.ServerReflectionResponse.SerializeToString,
    )
    handlers = grpc.method_handlers_generic_handler(SERVICE_NAME_V1, {"ServerReflectionInfo": info})
    server.add_generic_rpc_handlers((handlers,))
