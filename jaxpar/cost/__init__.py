"""The cost model, in one home: the formulas (`formulas`), reading compiled HLO (`hlo`),
a compiled step against the textbook (`ledger`), FLOPs and MFU (`throughput`), the
typed report of a run (`report`), and every layout predicted from shapes (`planner`)."""
