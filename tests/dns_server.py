"""A real DNS server on a loopback UDP port for the tests (dnspython's wire format), answering A/AAAA queries
from a table the test changes while it runs:

    with LoopbackDns({"sim.test": ["127.0.0.2"]}) as dns:   # dns.address == "127.0.0.1:PORT"
        dns.set("sim.test", ["127.0.0.2", "127.0.0.3"])
        dns.silent = True                                  # a resolver outage: queries get no answer at all

A name not in the table gets NXDOMAIN; a name with no address of the asked family, an empty answer.
"""

from __future__ import annotations

import ipaddress
import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class LoopbackDns:
    def __init__(self, records: dict[str, list[str]] | None = None) -> None:
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self.silent = False
        self.queries = 0
        for name, addresses in (records or {}).items():
            self.set(name, addresses)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loopback-dns", daemon=True)

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self._records[name.rstrip(".").lower()] = list(addresses)

    def __enter__(self) -> LoopbackDns:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.queries += 1
            if self.silent:
                continue
            try:
                query = dns.message.from_wire(wire)
            except dns.exception.DNSException:
                continue
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        for q in query.question:
            with self._lock:
                addresses = self._records.get(q.name.to_text().rstrip(".").lower())
            if addresses is None:
                response.set_rcode(dns.rcode.NXDOMAIN)
                continue
            family = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 6}.get(q.rdtype)
            chosen = [a for a in addresses if ipaddress.ip_address(a).version == family]
            if chosen:
                response.answer.append(dns.rrset.from_text_list(q.name, 0, dns.rdataclass.IN, q.rdtype, chosen))
        return response
