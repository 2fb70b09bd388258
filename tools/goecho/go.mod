module c10m.dev/tools/goecho

go 1.25
