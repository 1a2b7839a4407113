"""Each worker role answers every RPC of its service. The generated code has no servicer base
classes (hack/gen-protos.sh drops grpc_tools' defaults, which answered UNIMPLEMENTED), and
add_<Service>Servicer_to_server looks every method up when a worker registers its role: a role
missing one fails the worker's start, never a client's call later."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from splitserve_workers.colocated_worker import ColocatedRole
from splitserve_workers.decode_worker import DecodeRole
from splitserve_workers.prefill_worker import PrefillRole
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.proto import serving_pb2_grpc as pb_grpc

ROLES = [
    ("PrefillService", PrefillRole, pb_grpc.add_PrefillServiceServicer_to_server),
    ("DecodeService", DecodeRole, pb_grpc.add_DecodeServiceServicer_to_server),
    ("ColocatedService", ColocatedRole, pb_grpc.add_ColocatedServiceServicer_to_server),
]


@pytest.mark.parametrize(("service", "role", "add"), ROLES)
def test_role_implements_every_rpc_of_its_service(service: str, role: type, add: object) -> None:
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name[service].methods]
    assert methods, service
    for name in methods:
        ours = getattr(role, name, None)
        assert callable(ours), f"{role.__name__} does not implement {service}.{name}"
        assert name in vars(role), f"{role.__name__}.{name} is inherited, not its own"
    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        add(role.__new__(role), server)  # type: ignore[operator]  # the lookup a worker's start does
    finally:
        server.stop(None)


@pytest.mark.parametrize(("service", "role", "add"), ROLES)
def test_a_missing_rpc_fails_registration(service: str, role: type, add: object) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        with pytest.raises(AttributeError):
            add(object(), server)  # type: ignore[operator]
    finally:
        server.stop(None)
