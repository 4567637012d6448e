"""The cost model, in one home: the formulas (`formulas`), reading compiled HLO (`hlo`),
a compiled step against the textbook (`ledger`), FLOPs and MFU (`throughput`), the
typed report of a run (`report`), and every layout predicted from shapes (`planner`)."""

from jaxpar import moved


def __getattr__(name: str):  # the last release's jaxpar.cost module: now .formulas
    return moved.attribute(__name__, name)
