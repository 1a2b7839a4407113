"""Each worker role answers every RPC of its service: the generated servicer base classes'
defaults (grpc_tools writes them to raise NotImplementedError, which gRPC turns into
UNIMPLEMENTED) must never be what a real worker serves."""

from __future__ import annotations

import pytest
from splitserve_workers.colocated_worker import ColocatedRole
from splitserve_workers.decode_worker import DecodeRole
from splitserve_workers.prefill_worker import PrefillRole
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.proto import serving_pb2_grpc as pb_grpc


@pytest.mark.parametrize(
    ("service", "role", "base"),
    [
        ("PrefillService", PrefillRole, pb_grpc.PrefillServiceServicer),
        ("DecodeService", DecodeRole, pb_grpc.DecodeServiceServicer),
        ("ColocatedService", ColocatedRole, pb_grpc.ColocatedServiceServicer),
    ],
)
def test_role_overrides_every_rpc_of_its_service(service: str, role: type, base: type) -> None:
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name[service].methods]
    assert methods, service
    for name in methods:
        ours = getattr(role, name, None)
        assert callable(ours), f"{role.__name__} does not implement {service}.{name}"
        assert ours is not getattr(base, name), f"{role.__name__}.{name} is the generated stub"
