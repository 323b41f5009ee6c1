"""DraftStats: drafted and accepted tokens per proposer, for one request or a whole engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProposerStats:
    windows: int = 0    # windows in which this proposer's draft was sent
    drafted: int = 0    # draft tokens sent
    accepted: int = 0   # draft tokens accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per drafting window."""
        return self.accepted / self.windows if self.windows else 0.0


@dataclass
class DraftStats:
    by_proposer: dict[str, ProposerStats] = field(default_factory=dict)
    simulated: bool = False  # --simulate-acceptance: the acceptance is drawn, not measured

    def record(self, proposer: str, drafted: int, accepted: int) -> None:
        s = self.by_proposer.setdefault(proposer, ProposerStats())
        s.windows += 1
        s.drafted += drafted
        s.accepted += accepted

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.by_proposer.values())

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.by_proposer.values())

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        """JSON-ready summary (the server's usage extension)."""
        return {"simulated": self.simulated, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.acceptance, 4),
                "by_proposer": {name: {"windows": s.windows, "drafted": s.drafted,
                                       "accepted": s.accepted,
                                       "mean_accepted": round(s.mean_accepted, 3)}
                                for name, s in self.by_proposer.items()}}

    def summary(self) -> str:
        """One line for logs and `generate --verbose`."""
        if not self.drafted:
            return "no drafts"
        parts = [f"{name} {s.accepted}/{s.drafted} ({s.mean_accepted:.1f}/window)"
                 for name, s in self.by_proposer.items()]
        label = "SIMULATED drafts" if self.simulated else "drafts"
        return f"{label} accepted {self.accepted}/{self.drafted} ({self.acceptance:.0%}): " + \
            ", ".join(parts)
