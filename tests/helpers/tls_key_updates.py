"""Frequent KeyUpdates both ways with real peers (Envoy's BoringSSL, Node's OpenSSL): our record
layers change keys every RECORDS_PER_KEY_IN_TESTS records and ask the peer for a KeyUpdate of its
own each time (tls/records.py `KeyUpdates`); what each side did is counted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ambient_mesh.tls import records

RECORDS_PER_KEY_IN_TESTS = 64


@dataclass
class KeyUpdateCounts:
    ours: int = 0  # KeyUpdates we sealed (at our limit, or answering the peer)
    peers: int = 0  # KeyUpdates we read from the peer


def key_updates_both_ways(monkeypatch: pytest.MonkeyPatch) -> KeyUpdateCounts:
    """From now to the test's end (monkeypatch undoes it), for record layers made from now on."""
    counts = KeyUpdateCounts()
    seal, read = records.RecordLayer._key_update, records.RecordLayer._on_key_update

    def counting_seal(self: records.RecordLayer, *, requested: bool = False) -> bytes:
        counts.ours += 1
        return seal(self, requested=requested)

    def counting_read(self: records.RecordLayer, body: bytes, *, more: bool) -> None:
        counts.peers += 1
        read(self, body, more=more)

    monkeypatch.setattr(records.KeyUpdates, "records_per_key", RECORDS_PER_KEY_IN_TESTS)
    monkeypatch.setattr(records.KeyUpdates, "request_peer_update", True)
    monkeypatch.setattr(records.RecordLayer, "_key_update", counting_seal)
    monkeypatch.setattr(records.RecordLayer, "_on_key_update", counting_read)
    return counts
