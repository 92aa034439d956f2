"""`kvseal namespaces` (what a running engine holds, per final namespace and user; purge one) and `kvseal ssd
inspect` (what an SSD tier directory holds, offline). Tables for people, `--json` for tools."""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvseal.units import format_size

_COLUMNS = (
    ("namespace", "NAMESPACE"),
    ("uid", "UID"),
    ("resident_blocks", "MEM BLOCKS"),
    ("resident_bytes", "MEM BYTES"),
    ("ssd_blocks", "SSD BLOCKS"),
    ("ssd_bytes", "SSD BYTES"),
    ("hits", "HITS"),
    ("refused", "REFUSED"),
    ("last_used", "LAST USED"),
)


_WHICH_PORT = "pass --http HOST:PORT, the engine's HTTP address (kvseal serve --http-listen, default 127.0.0.1:9091)"


def _request(method: str, url: str, token: str | None) -> Any:
    """The JSON the engine answers; a failure exits with status 1 and one line naming the address and the fix."""
    address = urllib.parse.urlsplit(url).netloc
    request = urllib.request.Request(url, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", "")
        except (ValueError, AttributeError):
            message = ""
        raise SystemExit(f"kvseal: the engine at {url} answered {e.code}: {message or e.reason}") from None
    except (http.client.HTTPException, ConnectionResetError):
        # BadStatusLine, RemoteDisconnected: something listens there but speaks no HTTP/1.1, like the engine's gRPC
        # port (HTTP/2 only)
        raise SystemExit(
            f"kvseal: {address} did not answer HTTP: {_WHICH_PORT}, not its gRPC --listen address"
        ) from None
    except OSError as e:
        reason = getattr(e, "reason", e)
        why = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
        raise SystemExit(
            f"kvseal: no engine answers at {address}: {why}: start one (kvseal serve) or {_WHICH_PORT}"
        ) from None
    try:
        return json.loads(body)
    except ValueError:
        raise SystemExit(
            f"kvseal: {address} answered {url} with something that is not JSON, so it is not a kvseal engine: "
            f"{_WHICH_PORT}"
        ) from None


def _cell(key: str, value: Any) -> str:
    if key.endswith("_bytes"):
        return format_size(int(value)) if value else "0"
    if key == "refused":
        return ",".join(f"{r}={n}" for r, n in sorted(value.items())) or "-"
    if key == "last_used":
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value)) if value else "-"
    return str(value)


def table(rows: list[dict[str, Any]], columns: tuple[tuple[str, str], ...] = _COLUMNS) -> str:
    cells = [[title for _, title in columns]] + [[_cell(k, row.get(k, "")) for k, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def namespaces(http: str, token: str | None, as_json: bool) -> int:
    rows = _request("GET", f"http://{http}/v1/namespaces", token)
    rows.sort(key=lambda r: (r["namespace"], r["uid"]))
    print(json.dumps(rows, indent=1) if as_json else table(rows) if rows else "no namespaces")
    return 0


def purge(http: str, token: str | None, namespace: str, uid: int | None, as_json: bool) -> int:
    query = f"?uid={uid}" if uid is not None else ""
    url = f"http://{http}/v1/namespaces/{urllib.parse.quote(namespace, safe='')}{query}"
    purged = _request("DELETE", url, token)
    if as_json:
        print(json.dumps(purged, indent=1))
        return 0
    for p in purged:
        in_use = f", {p['memory_blocks_in_use']} in use stay until released" if p["memory_blocks_in_use"] else ""
        print(
            f"purged {p['namespace']} (uid {p['uid']}): {p['memory_blocks']} blocks from memory{in_use}, "
            f"{p['ssd_blocks']} from SSD"
        )
    return 0


def compare(http: str, token: str | None, a: str, b: str, as_json: bool) -> int:
    """Why two final namespaces cannot share blocks. Exit status 0 when they can, 1 when they cannot."""
    query = urllib.parse.urlencode({"a": a, "b": b})
    answer = _request("GET", f"http://{http}/v1/compatibility?{query}", token)
    if as_json:
        print(json.dumps(answer, indent=1))
    else:
        print(f"{a} and {b}: " + ("compatible" if answer["compatible"] else f"incompatible: {answer['message']}"))
    return 0 if answer["compatible"] else 1


def inspect_ssd(directories: list[str], verify: bool, as_json: bool) -> int:
    """What the tier directories hold, read-only (a running engine's directory is read as it is on disk)."""
    from kvseal.ssd.device import FileDevice
    from kvseal.ssd.tier import DiskTier

    try:
        devices = [FileDevice.existing(d) for d in directories]
    except OSError as e:
        print(f"kvseal ssd inspect: error: {e}", file=sys.stderr)
        return 1
    tier = DiskTier(devices)
    report, found = tier.inspect(verify=verify)
    tier.close()
    namespaces = [
        {"namespace": ns, "uid": tenant, **figures} for (tenant, ns), figures in sorted(found.items(), key=str)
    ]
    doc = {
        "directories": directories,
        "segments": report.segments,
        "records": report.records,
        "scanned_segments": report.scanned_segments,
        "torn_tails": report.torn_cut,
        "bad": report.bad,
        "rekeyed": report.rekeyed,
        "dropped_namespaces": report.dropped_namespaces,
        "namespaces": namespaces,
    }
    if as_json:
        print(json.dumps(doc, indent=1))
        return 0
    print(
        f"{', '.join(directories)}: {report.segments} segments, {report.records} records "
        f"({report.scanned_segments} segments unsealed: scanned; torn tails {report.torn_cut}; "
        f"bad {report.bad or 'none'})"
    )
    for old, new in report.rekeyed.items():
        print(f"  re-keyed on start: {old} -> {new}")
    for name in report.dropped_namespaces:
        print(f"  dropped on start (layout descriptor not built by this version): {name}")
    columns = [("namespace", "NAMESPACE"), ("uid", "UID"), ("records", "RECORDS"), ("page_bytes", "PAGE BYTES")]
    if verify:
        columns += [(r, r.upper()) for r in ("checksum", "digest", "truncated", "mismatch")]
        for row in namespaces:
            for r in ("checksum", "digest", "truncated", "mismatch"):
                row.setdefault(r, 0)
    print(table(namespaces, tuple(columns)) if namespaces else "no namespaces")
    return 0
