// Package printed reads the tables kubectl get prints, so tests can assert on the
// columns a user sees.
package printed

import (
	"fmt"
	"strings"
)

// FirstRow returns the first row of a kubectl get table as a map from column header
// to cell. Columns are left-aligned under their headers, so the row is cut where each
// header starts; an empty cell reads "".
func FirstRow(table string) (map[string]string, error) {
	lines := strings.Split(strings.TrimRight(table, "\n"), "\n")
	if len(lines) < 2 {
		return nil, fmt.Errorf("the table has no row:\n%s", table)
	}
	header, row := lines[0], lines[1]
	type column struct {
		name  string
		start int
	}
	var cols []column
	for i := 0; i < len(header); {
		for i < len(header) && header[i] == ' ' {
			i++
		}
		j := i
		for j < len(header) && header[j] != ' ' {
			j++
		}
		if i < j {
			cols = append(cols, column{header[i:j], i})
		}
		i = j
	}
	cells := map[string]string{}
	for k, c := range cols {
		from, to := min(c.start, len(row)), len(row)
		if k+1 < len(cols) {
			to = min(cols[k+1].start, len(row))
		}
		cells[c.name] = strings.TrimSpace(row[from:to])
	}
	return cells, nil
}
