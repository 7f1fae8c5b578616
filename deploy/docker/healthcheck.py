"""Container health check: exit 0 when moe-serve answers /v2/health/ready with 200, else 1.

The image's HEALTHCHECK and docker-compose.yml run it (the CUDA runtime image has no curl). It asks
where the service listens, as the service reads its settings: MOE_HOST (default 0.0.0.0; an
address of every interface, 0.0.0.0 or ::, is asked on loopback, 127.0.0.1 or ::1; an IPv6 one may
come in brackets) and MOE_HTTP_PORT (default 8000).
"""

from __future__ import annotations

import ipaddress
import os
import sys
import urllib.error
import urllib.request

DEFAULT_HOST = "0.0.0.0"  # service.config.Settings.host
DEFAULT_HTTP_PORT = "8000"  # service.config.Settings.http_port
TIMEOUT_S = 4.0  # under the HEALTHCHECK timeout (5 s), so a slow answer is reported, not killed


def probe_host(host: str) -> str:
    """The host part of the URL that reaches a server bound to `host` (as MOE_HOST gives it)."""
    host = host.strip() or DEFAULT_HOST  # (the service takes an empty MOE_HOST as unset)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return host  # a host name
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    return f"[{address}]" if address.version == 6 else str(address)


def main() -> int:
    host = probe_host(os.environ.get("MOE_HOST", DEFAULT_HOST))
    port = os.environ.get("MOE_HTTP_PORT", "").strip() or DEFAULT_HTTP_PORT
    url = f"http://{host}:{port}/v2/health/ready"
    # Never through a proxy: the check asks its own container, and a proxy set in the container's
    # environment (http_proxy, for pulling models, say) would otherwise get the request.
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:  # HTTPError (503: not ready) is a URLError
        sys.stderr.write(f"not ready: {url}: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
