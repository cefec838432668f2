// Command ollama_render renders conversations with a Modelfile's TEMPLATE the way Ollama does,
// with Go's own text/template and only the standard library.
//
// Usage: ollama_render MODELFILE < CONVERSATIONS.json > RENDERS.json
//
// The conversations (standard input) are a JSON list of {"messages": [...], "tools": [...]} in the shape of Ollama's
// /api/chat request (api/types.go: Message, ToolCall, Tool). The output is a JSON object:
// "prompts", the rendered prompt of each conversation, and "tool_call_tag", the text Ollama's
// tool parser would look for in the model's output.
//
// What is reproduced from Ollama (github.com/ollama/ollama, read, not copied):
//   - parser/parser.go: a TEMPLATE value in """ ... """ is taken verbatim, no escapes.
//   - template/template.go Parse: text/template with Option("missingkey=zero") and the function
//     `json` (encoding/json's Marshal); Execute: a template that names .Messages gets System,
//     Messages, Tools, Response "" and the Think fields.
//   - template/template.go collate: every system message's content joined with "\n\n" is
//     .System; consecutive messages of one role (tool results excepted) become one message whose
//     contents are joined with "\n\n" (the first message keeps its tool calls).
//   - template/template.go convertMessagesForTemplate / convertToolsForTemplate: tool-call
//     arguments and tool parameters' properties reach the template as plain Go maps (so ranging
//     them gives their keys sorted); a property's type is a list of strings (api.PropertyType).
//   - tools/template.go parseTag: the tool-call tag is the first non-blank text inside the first
//     `if` whose condition names .ToolCalls (the search of that text stops at the first action
//     or nested block), cut before any "{" and trimmed; "{" when there is none.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/template"
	"text/template/parse"
)

type property struct {
	Type        []string
	Items       any
	Description string
	Enum        []any
}

// propertyType reads api.PropertyType's JSON: one type name or a list of them.
func (p *property) UnmarshalJSON(b []byte) error {
	var raw struct {
		Type        json.RawMessage `json:"type"`
		Items       any             `json:"items"`
		Description string          `json:"description"`
		Enum        []any           `json:"enum"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		return err
	}
	p.Items, p.Description, p.Enum = raw.Items, raw.Description, raw.Enum
	if len(raw.Type) == 0 {
		return nil
	}
	var one string
	if json.Unmarshal(raw.Type, &one) == nil {
		p.Type = []string{one}
		return nil
	}
	return json.Unmarshal(raw.Type, &p.Type)
}

type parameters struct {
	Type       string              `json:"type"`
	Required   []string            `json:"required"`
	Properties map[string]property `json:"properties"`
}

type function struct {
	Name        string     `json:"name"`
	Description string     `json:"description"`
	Parameters  parameters `json:"parameters"`
}

type tool struct {
	Type     string   `json:"type"`
	Function function `json:"function"`
}

type callFunction struct {
	Index     int            `json:"index"`
	Name      string         `json:"name"`
	Arguments map[string]any `json:"arguments"`
}

type toolCall struct {
	ID       string       `json:"id"`
	Function callFunction `json:"function"`
}

type message struct {
	Role       string     `json:"role"`
	Content    string     `json:"content"`
	Thinking   string     `json:"thinking"`
	ToolCalls  []toolCall `json:"tool_calls"`
	ToolName   string     `json:"tool_name"`
	ToolCallID string     `json:"tool_call_id"`
}

type conversation struct {
	Messages []message `json:"messages"`
	Tools    []tool    `json:"tools"`
}

// modelfileTemplate is the text between TEMPLATE """ and the next """.
func modelfileTemplate(text string) (string, error) {
	start := strings.Index(text, "\nTEMPLATE \"\"\"")
	if start < 0 {
		return "", fmt.Errorf("no TEMPLATE \"\"\"...\"\"\" line")
	}
	rest := text[start+len("\nTEMPLATE \"\"\""):]
	end := strings.Index(rest, "\"\"\"")
	if end < 0 {
		return "", fmt.Errorf("TEMPLATE has no closing \"\"\"")
	}
	return rest[:end], nil
}

// collate merges as Ollama's collate does (see the package comment).
func collate(msgs []message) (string, []*message) {
	var system []string
	var out []*message
	for i := range msgs {
		m := &msgs[i]
		m.Role = strings.ToLower(m.Role) // api.Message's UnmarshalJSON lowercases roles
		if m.Role == "system" {
			system = append(system, m.Content)
		}
		if n := len(out); n > 0 && out[n-1].Role == m.Role && m.Role != "tool" {
			out[n-1].Content += "\n\n" + m.Content
		} else {
			out = append(out, m)
		}
	}
	return strings.Join(system, "\n\n"), out
}

func render(t *template.Template, c conversation) (string, error) {
	system, msgs := collate(c.Messages)
	var tools []tool
	if c.Tools != nil {
		tools = c.Tools
	}
	var b strings.Builder
	err := t.Execute(&b, map[string]any{
		"System": system, "Messages": msgs, "Tools": tools, "Response": "",
		"Think": false, "ThinkLevel": "", "IsThinkSet": false,
	})
	return b.String(), err
}

// namesToolCalls says whether an if's condition mentions the field .ToolCalls.
func namesToolCalls(n *parse.IfNode) bool {
	for _, cmd := range n.Pipe.Cmds {
		for _, arg := range cmd.Args {
			if f, ok := arg.(*parse.FieldNode); ok {
				for _, id := range f.Ident {
					if id == "ToolCalls" {
						return true
					}
				}
			}
		}
	}
	return false
}

func branches(n parse.Node) []*parse.ListNode {
	switch n := n.(type) {
	case *parse.IfNode:
		return []*parse.ListNode{n.List, n.ElseList}
	case *parse.RangeNode:
		return []*parse.ListNode{n.List, n.ElseList}
	case *parse.WithNode:
		return []*parse.ListNode{n.List, n.ElseList}
	case *parse.ListNode:
		return []*parse.ListNode{n}
	}
	return nil
}

func findToolCallsIf(nodes []parse.Node) *parse.IfNode {
	for _, n := range nodes {
		if i, ok := n.(*parse.IfNode); ok && namesToolCalls(i) {
			return i
		}
		for _, b := range branches(n) {
			if b != nil {
				if found := findToolCallsIf(b.Nodes); found != nil {
					return found
				}
			}
		}
	}
	return nil
}

// firstText returns the first non-blank text, and whether the search must stop here.
func firstText(nodes []parse.Node) (string, bool) {
	for _, n := range nodes {
		switch n := n.(type) {
		case *parse.TextNode:
			if strings.TrimSpace(string(n.Text)) != "" {
				return string(n.Text), true
			}
		case *parse.ActionNode:
			return "", true
		case *parse.ListNode:
			if text, stop := firstText(n.Nodes); stop {
				return text, true
			}
		case *parse.IfNode, *parse.RangeNode, *parse.WithNode:
			for _, b := range branches(n) {
				if b != nil {
					if text, _ := firstText(b.Nodes); text != "" {
						return text, true
					}
				}
			}
			return "", true
		}
	}
	return "", false
}

func toolCallTag(t *template.Template) string {
	n := findToolCallsIf(t.Tree.Root.Nodes)
	if n == nil {
		return "{"
	}
	text, _ := firstText(n.List.Nodes)
	tag, _, _ := strings.Cut(strings.ReplaceAll(text, "\r\n", "\n"), "{")
	if tag = strings.TrimSpace(tag); tag == "" {
		return "{"
	}
	return tag
}

func run() error {
	if len(os.Args) != 2 {
		return fmt.Errorf("usage: ollama_render MODELFILE < CONVERSATIONS.json")
	}
	mf, err := os.ReadFile(os.Args[1])
	if err != nil {
		return err
	}
	src, err := modelfileTemplate("\n" + string(mf))
	if err != nil {
		return err
	}
	funcs := template.FuncMap{"json": func(v any) string { b, _ := json.Marshal(v); return string(b) }}
	t, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(src)
	if err != nil {
		return err
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		return err
	}
	var convs []conversation
	if err := json.Unmarshal(data, &convs); err != nil {
		return err
	}
	out := make([]string, len(convs))
	for i, c := range convs {
		if out[i], err = render(t, c); err != nil {
			return fmt.Errorf("conversation %d: %w", i, err)
		}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetEscapeHTML(false)
	return enc.Encode(map[string]any{"prompts": out, "tool_call_tag": toolCallTag(t)})
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "ollama_render:", err)
		os.Exit(1)
	}
}
