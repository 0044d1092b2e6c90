"""The router: the conductor (the paper's Algorithm 1), its estimators, baseline policies, and
the offline trace simulator. See README.md in this folder."""

from __future__ import annotations

from kvflow.router.conductor import Conductor, find_state
from kvflow.router.config import RouterConfig
from kvflow.router.errors import (
    FitError,
    ProfileFormatError,
    ProfileMismatchError,
    RouterError,
    TraceFormatError,
    UnknownInstanceError,
    UnknownPolicyError,
)
from kvflow.router.estimators import (
    PROFILE_FILENAME,
    DecodeSample,
    DecodeTimeModel,
    PrefillTimeModel,
    ProfileSample,
    TransferEstimator,
)
from kvflow.router.index import BatchPrefixIndex, HolderPrefixIndex, PrefixIndex
from kvflow.router.instances import InstanceKind, InstanceSnapshot, InstanceState
from kvflow.router.local_index import LocalPrefixIndex
from kvflow.router.metadata_index import MetadataPrefixIndex
from kvflow.router.policies import make_policy, policy_names
from kvflow.router.profile import Profile, load_profile
from kvflow.router.sim_config import SimulationConfig
from kvflow.router.sim_report import InstanceLoad, RequestOutcome, SimulationReport
from kvflow.router.simulator import simulate
from kvflow.router.trace import TraceRecord, hash_id_key, read_trace
from kvflow.router.types import (
    DecodeCandidate,
    Estimate,
    PolicyChoice,
    PrefillCandidate,
    PullPlan,
    Rejection,
    RejectReason,
    RouteDecision,
    RouteRequest,
)

__all__ = [
    "PROFILE_FILENAME",
    "BatchPrefixIndex",
    "Conductor",
    "DecodeCandidate",
    "DecodeSample",
    "DecodeTimeModel",
    "Estimate",
    "FitError",
    "HolderPrefixIndex",
    "InstanceKind",
    "InstanceLoad",
    "InstanceSnapshot",
    "InstanceState",
    "LocalPrefixIndex",
    "MetadataPrefixIndex",
    "PolicyChoice",
    "PrefillCandidate",
    "PrefillTimeModel",
    "PrefixIndex",
    "Profile",
    "ProfileFormatError",
    "ProfileMismatchError",
    "ProfileSample",
    "PullPlan",
    "RejectReason",
    "Rejection",
    "RequestOutcome",
    "RouteDecision",
    "RouteRequest",
    "RouterConfig",
    "RouterError",
    "SimulationConfig",
    "SimulationReport",
    "TraceFormatError",
    "TraceRecord",
    "TransferEstimator",
    "UnknownInstanceError",
    "UnknownPolicyError",
    "find_state",
    "hash_id_key",
    "load_profile",
    "make_policy",
    "policy_names",
    "read_trace",
    "simulate",
]
