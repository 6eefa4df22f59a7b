"""Extending gRPC handlers through the server's interceptor registry, never by
forking them: ``rewrap`` rebuilds a method handler around its behaviour, and
``ParseErrorsAsInvalidArgument`` uses it so that request bytes which do not
parse as the method's message are an INVALID_ARGUMENT naming the problem,
instead of gRPC's own INTERNAL "Exception deserializing request!" (which would
read as a server bug). The admin guard (``expertmesh.infra.security.admin_auth``)
uses it too."""

from __future__ import annotations

from typing import Callable

import grpc

Behavior = Callable[..., object]

_FACTORIES = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def rewrap(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior], Behavior], request_deserializer=None
) -> grpc.RpcMethodHandler:
    """The same method with its behaviour replaced by ``wrap(behaviour)`` and the given deserializer."""
    for kind, make in _FACTORIES:
        behavior = getattr(handler, kind)
        if behavior is not None:
            return make(
                wrap(behavior),
                request_deserializer=request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class ParseErrorsAsInvalidArgument(grpc.ServerInterceptor):
    """Parse unary requests inside the handler, so a malformed one is answered INVALID_ARGUMENT."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method

        def wrap(behavior: Behavior) -> Behavior:
            def parsed(raw: bytes, context: grpc.ServicerContext):
                try:
                    request = parse(raw)
                except Exception as err:  # protobuf's DecodeError, or whatever a custom deserializer raises
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request bytes do not parse: {err}")
                return behavior(request, context)

            return parsed

        return rewrap(handler, wrap)
