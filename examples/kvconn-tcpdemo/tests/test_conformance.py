from kvconn.conformance import ConformanceSuite


class TestTcpdemoConformance(ConformanceSuite):
    backend_name = "tcpdemo"
