package controllers

import (
	"os"
	"slices"
	"testing"
)

// budgetStepsHeading is the section of docs/budgets.md that lists a budget's reconcile
// steps.
const budgetStepsHeading = "## The budget's reconcile: steps"

// TestBudgetDocListsTheSteps keeps the step list in docs/budgets.md equal to the steps
// the budget reconciler runs for a live budget, in order.
func TestBudgetDocListsTheSteps(t *testing.T) {
	raw, err := os.ReadFile("../docs/budgets.md")
	if err != nil {
		t.Fatal(err)
	}
	doc, found := documentedSteps(string(raw), budgetStepsHeading)
	if !found {
		t.Fatalf("docs/budgets.md has no heading %q", budgetStepsHeading)
	}
	var code []string
	for _, s := range (&RedPacketBudgetReconciler{}).budgetNormalSteps() {
		code = append(code, s.name)
	}
	if len(code) == 0 {
		t.Fatal("budgetNormalSteps lists no step")
	}
	if !slices.Equal(doc, code) {
		t.Errorf("docs/budgets.md lists the budget's reconcile steps as\n  %q\nbut budgetNormalSteps (controllers/redpacketbudget_phases.go) runs\n  %q",
			doc, code)
	}
}
