"""TenantLimits alone, on a hand-driven clock: concurrency and token-bucket rate per tenant,
the refusal naming the config field and when to retry; and the config's validation."""

from __future__ import annotations

import pytest

from kvflow.stages.api.limits import MAX_BUCKETS, TenantLimits
from kvflow.stages.errors import RateLimited
from kvflow.stages.serve.config import RoutingConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_concurrency_is_per_tenant_and_given_back_once() -> None:
    limits = TenantLimits(max_concurrency=2)
    a1, a2 = limits.admit("a"), limits.admit("a")
    with pytest.raises(RateLimited, match="tenant_max_concurrency") as err:
        limits.admit("a")
    assert err.value.limit == "tenant_max_concurrency" and err.value.retry_after_s == 1.0
    limits.admit("b")  # another tenant is not affected
    a1.release()
    a1.release()  # idempotent: still one place free, not two
    assert limits.in_flight("a") == 1
    limits.admit("a")
    with pytest.raises(RateLimited):
        limits.admit("a")
    a2.release()
    assert limits.in_flight("a") == 1


def test_token_bucket_burst_then_rate() -> None:
    clock = Clock()
    limits = TenantLimits(rate_per_s=2.0, burst=3, clock=clock)
    for _ in range(3):
        limits.admit("a").release()
    with pytest.raises(RateLimited, match="tenant_rate_per_s") as err:
        limits.admit("a")
    assert err.value.retry_after_s == pytest.approx(0.5)
    limits.admit("b").release()  # b has its own bucket
    clock.now += 0.25
    with pytest.raises(RateLimited) as err:
        limits.admit("a")
    assert err.value.retry_after_s == pytest.approx(0.25)
    clock.now += 0.25
    limits.admit("a").release()  # one token refilled in 0.5 s
    clock.now += 100.0
    for _ in range(3):  # refilled to the burst, never beyond
        limits.admit("a").release()
    with pytest.raises(RateLimited):
        limits.admit("a")


def test_a_request_refused_for_concurrency_takes_no_token() -> None:
    clock = Clock()
    limits = TenantLimits(max_concurrency=1, rate_per_s=1.0, burst=2, clock=clock)
    held = limits.admit("a")
    for _ in range(5):
        with pytest.raises(RateLimited, match="tenant_max_concurrency"):
            limits.admit("a")
    held.release()
    limits.admit("a").release()  # the second token of the burst is still there


def test_no_limits_admit_everything() -> None:
    limits = TenantLimits.from_config(RoutingConfig())
    permits = [limits.admit("a") for _ in range(1000)]
    assert limits.in_flight("a") == 1000
    for p in permits:
        p.release()
    assert limits.in_flight("a") == 0


def test_buckets_are_bounded() -> None:
    clock = Clock()
    limits = TenantLimits(rate_per_s=10.0, clock=clock)
    for i in range(MAX_BUCKETS + 10):
        limits.admit(f"t{i}").release()
    clock.now += 1.0  # every bucket full again: forgotten when the next tenant comes
    limits.admit("new").release()
    assert len(limits._buckets) <= 2


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_prompt_bytes": 0}, "max_prompt_bytes"),
        ({"tenant_max_concurrency": 0}, "tenant_max_concurrency"),
        ({"tenant_max_concurrency": 1.5}, "tenant_max_concurrency"),
        ({"tenant_rate_per_s": 0.0}, "tenant_rate_per_s"),
        ({"tenant_rate_per_s": float("inf")}, "tenant_rate_per_s"),
        ({"tenant_rate_per_s": float("nan")}, "tenant_rate_per_s"),
        ({"tenant_rate_per_s": "5"}, "tenant_rate_per_s"),
        ({"tenant_rate_per_s": 1.0, "tenant_burst": 0}, "tenant_burst"),
        ({"tenant_burst": 4}, "tenant_burst"),
    ],
)
def test_config_validation_names_the_field(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RoutingConfig(**fields)  # type: ignore[arg-type]
