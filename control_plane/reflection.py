"""gRPC server reflection under both of its names: `grpc.reflection.v1alpha` (what grpcio-reflection
serves) and `grpc.reflection.v1` (what newer clients ask for first: grpcurl, Postman, grpcui).

grpcio-reflection ships only v1alpha. The two versions' messages are the same on the wire (v1 is
v1alpha's file under a new package name, every field number and type unchanged), so one servicer
answers both; v1 is registered as a generic handler that uses v1alpha's message classes.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
SERVICE_NAME_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection for `service_names` (reflection's own two names are added) on `server`."""
    _register_v1_descriptor()
    servicer = ReflectionServicer((*service_names, SERVICE_NAME, SERVICE_NAME_V1))
    reflection_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb.ServerReflectionResponse.SerializeToString,
    )
    handlers = grpc.method_handlers_generic_handler(SERVICE_NAME_V1, {"ServerReflectionInfo": info})
    server.add_generic_rpc_handlers((handlers,))


V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    """v1's file in the default descriptor pool, so that reflection describes the v1 service it
    lists: v1alpha's file under v1's package and file name (the messages are the same)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, "grpc.reflection.v1"
    pool.Add(proto)
