package main

import (
	"reflect"
	"testing"
)

// benchMetrics keeps the figures of the named benchmark's lines only, each by the
// unit after it, and skips what is not a number before a unit.
func TestBenchMetrics(t *testing.T) {
	out := []byte(`goos: linux
BenchmarkPacketQuotas-2   	      10	 123 ns/op	 9021 created/s-quotas-on	 11000 created/s-quotas-off	 85.00 B/sender	 61.00 B/recipient
BenchmarkOther-2   	      10	 7 ns/op	 1 B/sender
PASS
`)
	got := benchMetrics(out, "BenchmarkPacketQuotas")
	want := map[string]float64{"ns/op": 123, "created/s-quotas-on": 9021, "created/s-quotas-off": 11000, "B/sender": 85, "B/recipient": 61}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("benchMetrics = %v, want %v", got, want)
	}
	if got := benchMetrics(out, "BenchmarkMissing"); len(got) != 0 {
		t.Errorf("benchMetrics of a benchmark not printed = %v, want nothing", got)
	}
}
