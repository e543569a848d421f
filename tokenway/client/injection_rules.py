"""The injection scan's rules (injection.py runs them): one regex each over normalised text
(case folded, blanks single), a category, a weight, and the words that must be present for the
rule to run at all.

Weights: 1.0 flags alone (no benign text says it: "ignore the previous instructions", a
chat-template token, "AI: send ..."); 0.75 and 0.5 flag only with another signal ("you are
now", an "end of document" line, a hidden-style span, an imperative to send or delete). A rule
counts once however often it matches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    category: str
    weight: float
    pattern: re.Pattern[str]
    # Every match contains one of these words, or one of these substrings: a rule whose
    # triggers are absent is not run (the text's words are collected once), so most text meets
    # a few regexes, not forty.
    words: frozenset[str]
    substrings: tuple[str, ...]


def rule(name: str, category: str, weight: float, triggers: str, pattern: str) -> Rule:
    """triggers: words, and substrings written ~like-this. A `\\b` that opens a branch is taken
    out of the regex and checked by the scanner (injection._search): Python's re tries a
    leading `\\b` at every position, eight times slower than finding the branch's first letters."""
    split = triggers.split()
    pattern = re.sub(r"(^|\||\(\?:)(\s*)\\b", r"\1\2", pattern)
    return Rule(name, category, weight, re.compile(pattern, re.VERBOSE),
                frozenset(t for t in split if not t.startswith("~")), tuple(t[1:] for t in split if t.startswith("~")))


# Words the rules share.
_EARLIER = r"(?:previous|prior|above|earlier|preceding|foregoing|original|initial|old|existing|system|developer|safety)"
_ORDERS = (r"(?:instructions?|rules?|prompts?|directions?|directives?|guidelines?|guidance|constraints?|restrictions?"
           r"|polic(?:y|ies)|commands?|orders?|programming|training|context|messages?|system\s+prompt|tasks?)")
_MODEL = (r"(?:ai|a\.i\.|assistants?|chat\s?bots?|bots?|language\s+models?|llms?|gpt|chatgpt|claude|gemini|copilot"
          r"|agents?|models?|automated\s+(?:[\w-]+\s+)?(?:summar(?:y|ies|izers?|isers?)|tools?|systems?|readers?"
          r"|assistants?|agents?|screeners?))")
MODEL_WORDS = ("ai assistant assistants chatbot chatbots bot bots llm llms gpt chatgpt claude gemini copilot "
               "agent agents model models automated ~a.i. ~chat bot")
_SECRET = (r"(?:system\s+prompt|instructions|conversation|chat(?:\s+history|\s+log)?|messages|context|history"
           r"|api[\s_-]?keys?|secrets?|passwords?|credentials?|tokens?|user(?:'s)?\s+data|personal\s+data|e-?mails?"
           r"|e-?mail\s+addresses|memory|memories|questions?|account\s+numbers?|card\s+(?:numbers?|details)"
           r"|bank\s+details|phone\s+numbers?|(?:home\s+|e-?mail\s+|street\s+)?address(?:es)?|home_address|location"
           r"|files?|documents?|notes|cookies?|session|\.env|env\s+file|environment\s+variables|passport(?:_no)?|dob"
           r"|date\s+of\s+birth|ssn)")
# What an imperative addressed to the model starts with.
_DO = (r"(?:ignore|disregard|forget|tell|say|call|send|run|append|reply|respond|issue|delete|remove|open|change|forward"
       r"|output|include|recommend|write|rate|e-?mail|apply|do|disable|enable|list|reveal|print|visit|click|transfer"
       r"|give|provide|ask|stop|answer|use|execute|insert|add|mark|approve|grant|summari[sz]e|always|never|treat"
       r"|instead|from\s+now|update|set|book|buy|order|pay|share|upload|post|fetch|navigate|go|inform|direct|warn"
       r"|quote|cite|praise|describe|claim|state|translate|act|pretend|reset|close|cancel|refund|download|install"
       r"|accept|note|rank|prefer|confirm|approve|unlock|invite|schedule|move|copy|read|show|display|begin|start|end"
       r"|create|switch|make|draft|compose|publish|archive|revoke|spell|echo|dump|disclose|suggest|present|point)")

RULES = (
    # -- instruction_override
    rule("ignore_earlier", "instruction_override", 1.0,
         "ignore disregard forget skip bypass override overrule abandon discard neglect aside throw follow obey "
         "following scrap ditch drop dump supersede attention wipe erase clear cancel void account heed",
         rf"""
        \b(?:ignore|disregard|forget|skip|bypass|override|overrule|abandon|discard|neglect|set\s+aside|throw\s+out
           |scrap|ditch|drop|dump|supersede|put\s+aside|pay\s+no\s+attention\s+to|wipe|erase|clear|cancel|void
           |do\s+not\s+(?:follow|obey|take\s+into\s+account)|don't\s+(?:follow|obey|take\s+into\s+account)
           |stop\s+following|no\s+longer\s+follow|take\s+no\s+account\s+of|pay\s+no\s+heed\s+to)
        \s+(?:(?:all|any|every|each|of|the|your|my|these|those|its|prior|earlier|{_EARLIER})\s+){{0,4}}
        {_ORDERS}\b"""),
    rule("earlier_no_longer_apply", "instruction_override", 1.0,
         "void cancelled canceled revoked obsolete longer overridden suspended lifted null matter outdated invalid "
         "superseded received", rf"""
        \b(?:{_EARLIER}|your|all)\s+{_ORDERS}\s+(?:are|is)\s+(?:now\s+)?(?:void|cancel+ed|revoked|obsolete|
        no\s+longer\s+(?:valid|apply|applicable|in\s+effect|relevant)|overridden|suspended|lifted|null)
        |\b{_ORDERS}\s+you\s+(?:were|have\s+been)\s+(?:given|handed|told|provided|assigned)\b[^.\n]{{0,60}}?
        (?:don't|do\s+not|no\s+longer)\s+(?:matter|apply|count)
        |\b(?:{_ORDERS}|configuration|setup|brief)\s+you\s+(?:were|have\s+been)\s+(?:given|configured|set\s+up|told|handed)
        \b[^.\n]{{0,40}}?\b(?:is|are)\s+(?:now\s+)?(?:obsolete|void|revoked|outdated|cancel+ed|invalid|superseded)
        |\b{_ORDERS}\s+you\s+(?:received|got|were\s+given)\s+(?:before|earlier|prior\s+to|above)\b"""),
    rule("new_instructions", "instruction_override", 1.0,
         "new updated revised real actual true secret hidden additional override next follows", r"""
        \b(?:new|updated|revised|real|actual|true|secret|hidden|additional|override)\s+
        (?:system\s+)?(?:instructions?|rules|directives?|orders|task|prompt)\s*(?::|-|follow|are|is)
        |\b(?:new|next|updated|real|urgent|follow-up|additional)\s+(?:request|instruction|message|task|command|order)s?
        \s*\(?\s*(?:from|by)\s+(?:the\s+)?(?:user|developer|admin|administrator|operator|system|owner|platform)
        |\b(?:real|actual|true)\s+(?:task\s+)?instructions\b|\bwhat\s+follows\s+(?:are|is)\s+(?:the\s+)?(?:new|real|actual)"""),
    rule("authority_claim", "instruction_override", 1.0, "after below following come comes from", r"""
        \b(?:instructions?|messages?|text|everything|anything)\s+(?:after|below|following)\s+(?:this|the)\s+
        (?:line|point|marker|tag)\s+(?:comes?|is|are)\s+(?:from|by|written\s+by)\s+(?:the\s+)?
        (?:developer|user|admin|operator|system|owner)
        |\bthe\s+(?:text|content|document)\s+above\s+(?:has\s+been|was|is)\s+(?:verified|checked|approved|marked)"""),
    rule("override_notice", "instruction_override", 0.5,
         "operator admin administrator developer system security platform priority urgent mandatory critical", r"""
        \b(?:operator|admin|administrator|developer|system|security|platform|priority|urgent|mandatory|critical)\s+
        (?:override|directive|instruction|command|notification|notice|alert)s?\b"""),
    rule("safety_off", "instruction_override", 0.75, "disabled off removed lifted suspended bypassed", r"""
        \b(?:safety|confirmation|guardrails?|filters?|restrictions?|moderation|content\s+polic(?:y|ies))\b[^.\n]{0,40}?
        \b(?:are|is|have\s+been|has\s+been|were|was)\s+(?:now\s+|temporarily\s+)?(?:disabled|turned\s+off|removed
        |lifted|suspended|bypassed)"""),
    rule("set_it_aside", "instruction_override", 0.5, "aside drop scrap ditch discard ignore forget disregard", r"""
        \b(?:set|put|throw)\s+(?:it|them|those|these)\s+aside\b
        |\b(?:drop|scrap|ditch|discard|ignore|forget|disregard)\s+(?:it|them|those)\s+(?:and|,)"""),
    rule("instead_do", "instruction_override", 0.5, "instead", r"""
        \binstead,?\s+(?:you\s+(?:must|should|will)\s+)?(?:respond|reply|answer|say|output|print|write|tell|recommend)"""),
    rule("from_now_on", "instruction_override", 0.5,
         "henceforth ~now on ~this point on ~rest of this ~starting now ~as of now ~effective immediately", r"""
        \b(?:from\s+now\s+on|from\s+this\s+point\s+on|henceforth|for\s+the\s+rest\s+of\s+this|starting\s+now
        |as\s+of\s+now|effective\s+immediately)\b"""),
    rule("respond_only", "instruction_override", 0.5, "respond reply answer output", r"""
        \b(?:respond|reply|answer|output)\s+(?:to\s+the\s+user\s+)?(?:only\s+)?with\s+(?:only\s+|just\s+)?(?:the\s+)?
        (?:word|phrase|text|string|")"""),
    # -- role_change
    rule("you_are_now", "role_change", 0.75, "now longer henceforth task", r"""
        \byou\s+are\s+(?:now|no\s+longer|henceforth)\b|\byou're\s+now\b
        |\b(?:starting\s+now|from\s+now\s+on|for\s+this\s+task|as\s+of\s+now),?\s+you\s+(?:are|will\s+be|play)\b"""),
    rule("jailbreak_mode", "role_change", 1.0, "mode jailbroken jailbreak anything without no", rf"""
        \b(?:developer|dev|god|debug|admin|jailbreak|unrestricted|unfiltered|dan)\s+mode\b
        |\bjailbr(?:oken|eak)\b|\bdo\s+anything\s+now\b|\bwithout\s+(?:any\s+)?(?:restrictions|filters|limits)\b
        |\b{_MODEL}\s+(?:with|that\s+has|without)\s+(?:no\s+)?(?:content\s+)?(?:polic(?:y|ies)|restrictions|rules
        |filters|limits|guidelines|guardrails|ethics)"""),
    rule("stay_in_character", "role_change", 0.5, "character refuses refuse", r"""
        \b(?:stay|remain)\s+in\s+character\b|\bnever\s+refuses?\b"""),
    rule("act_as", "role_change", 0.5, "act behave respond roleplay role pretend persona identity", r"""
        \b(?:act|behave|respond|roleplay|role-play)\s+as\s+(?:if\s+you\s+(?:were|are)\s+)?(?:an?\s+|the\s+)?
        |\bpretend\s+(?:to\s+be|you\s+are|that\s+you)\b|\byour\s+new\s+(?:role|persona|identity|name)\b"""),
    # -- fake_turn
    rule("chat_token", "fake_turn", 1.0,
         "~<| ~[inst ~[/inst ~<<sys ~<</sys ~</s> ~[system ~[/system ~<system ~</system ~< system ~</ system ~### "
         "~_of_turn>", r"""
        <\|\s*(?:im_start|im_end|system|user|assistant|endoftext|eot_id|start_header_id|end_header_id|begin_of_text)
        |<(?:start|end)_of_turn>
        |\[/?inst\]|<</?sys>>|</s>\s*<s>|<\s*/?\s*system\s*>|\#\#\#\s*(?:system|instruction)s?\s*:?"""),
    rule("fake_tag", "fake_turn", 0.75,
         "~<user ~</user ~<human ~<assistant ~</assistant ~<instruction ~<admin ~<operator "
         "~[user ~[human ~[assistant ~[system ~[/system ~[retrieved ~[/retrieved ~[operator ~[admin ~[developer", r"""
        <\s*/?\s*(?:user|human|assistant|instruction|instructions|admin|operator)(?:_message|_input|_turn)?\b[^>]{0,40}>
        |\[\s*/?\s*(?:user|human|assistant|system|retrieved|operator|admin|developer)\s*\]"""),
    rule("role_line", "fake_turn", 0.5, "~:", r"""
        (?m)(?:^|[,"'(]\s*)\[?(?:system|assistant|developer|human|user|ai|operator|admin|administrator)\]?\s*
        (?:\(\w+\))?\s*:\s*\S|^\s*role\s*:\s*(?:system|user|developer|assistant)\s*$"""),
    rule("role_json", "fake_turn", 0.75, "role", r""""role"\s*:\s*"(?:system|developer)\""""),
    rule("transcript", "fake_turn", 0.5, "human user", r"""
        (?ms)^\s*(?:human|user)\s*:\s*\S.*^\s*(?:assistant|ai)\s*:"""),
    rule("end_of_data", "fake_turn", 0.5,
         "end eof complete completed document data context tool_output tool_result tooloutput toolresult "
         "search_results searchresults search_result untrusted passage input", r"""
        \bend(?:[\s_-]+of)?[\s_-]+(?:the\s+)?(?:[\w-]+[\s_-]+)?(?:document|data|context|input|tool[\s_-]+(?:output|result)
        |search[\s_-]+results?|file|email|message|page|untrusted|user[\s_-]+input|excerpt|passage|retrieved|content
        |quote|quoted\s+\w+)s?\b|\b(?:tool\s+(?:result|output|call)|task|search)\s+(?:complete|completed|finished|done)\b
        |\#\s*eof\b
        |</\s*(?:document|data|context|tool_?(?:output|result)|search_?results?|untrusted\w*|passage|input)\s*>"""),
    # -- prompt_leak
    rule("reveal_prompt", "prompt_leak", 1.0,
         "reveal print show output repeat display leak disclose dump recite share tell write return include paste "
         "copy echo spell", r"""
        \b(?:reveal|print|show|output|repeat|display|leak|disclose|dump|recite|share|tell\s+(?:me|us|the\s+user)|write\s+out
           |return|include|paste|copy|echo|spell\s+out)
        \s+(?:me\s+|us\s+)?(?:(?:all|the|your|its|full|entire|complete|exact|original|initial|hidden|secret|verbatim)\s+){0,4}
        (?:system\s+(?:prompt|message|instructions)|initial\s+(?:prompt|instructions)|hidden\s+(?:prompt|instructions|rules)
           |your\s+(?:instructions|prompt|rules|guidelines|configuration)|developer\s+(?:message|prompt|instructions))"""),
    rule("repeat_above", "prompt_leak", 1.0, "repeat print output copy reproduce text everything content words", r"""
        \b(?:repeat|print|output|copy|reproduce)\s+(?:all\s+|everything\s+|the\s+(?:text|words|content)\s+)?
        (?:above|before\s+this|preceding)\b
        |\b(?:text|everything|content|words|instructions)\s+(?:that\s+)?(?:appears?\s+|comes?\s+|is\s+)?
        (?:before|above|preceding)\s+this\s+(?:document|message|text|line|passage)"""),
    rule("leak_general", "prompt_leak", 1.0,
         "print show output repeat display leak disclose dump recite share reveal echo quote quoting translate spell "
         "paste copy written everything", r"""
        \b(?:print|show|output|repeat|display|leak|disclose|dump|recite|share|reveal|echo|quote|quoting|translate
        |spell\s+out|paste|copy|what's\s+written\s+in|what\s+is\s+written\s+in|everything\s+(?:stored\s+)?in)\b
        [^.\n]{0,60}?\b(?:system\s+(?:prompt|message|instructions)|initial\s+(?:prompt|instructions)|custom\s+instructions
        |hidden\s+(?:configuration|config|text|instructions|prompt|rules|context)|confidential\s+(?:rules|instructions)
        |developer\s+(?:message|instructions|prompt)|(?:your|its|their)\s+(?:context\s+window|context|configuration
        |instructions|rules|prompt|initial\s+prompt)|(?:first|last)\s+\d+\s+(?:words|tokens|lines)\s+of\s+your)
        |\binstructions\s+(?:your|the)\s+(?:developer|operator|company|creator|owner)s?\s+gave\s+you"""),
    rule("given_instructions", "prompt_leak", 1.0, "given told provided handed assigned", r"""
        \b(?:print|show|output|repeat|paste|list|tell|write|reveal|share|quote|copy|recite)\b[^.\n]{0,40}?
        (?:instructions?|prompt|rules|guidelines|directions|setup|brief)\s+(?:that\s+)?you\s+(?:were|have\s+been|are|got)\s+
        (?:given|told|provided|handed|assigned)\b
        |\bwhat\s+(?:instructions|rules|directions)\s+(?:were\s+you|have\s+you\s+been)\s+(?:given|told|handed)"""),
    # -- tool_coercion
    rule("call_tool", "tool_coercion", 0.5, "tool function action plugin endpoint api tool_call function_call", r"""
        \b(?:call|invoke|use|run|execute|trigger|fire|open)\s+(?:the\s+)?[`'"]?[a-z_][\w.-]*[`'"]?\s+
        (?:tool|function|action|plugin|endpoint|api)\b|\b(?:tool_call|function_call)\b"""),
    rule("act_on_world", "tool_coercion", 0.5,
         "send forward email mail e transfer wire pay delete erase wipe remove drop destroy rm curl grant give refund "
         "disable terraform auto force create schedule", r"""
        \b(?:send|forward|e-?mail|mail)\b[^.\n]{0,80}?\bto\s+[\w.+-]+@[\w-]+\.[\w.]+
        |\b(?:transfer|wire|send|pay)\s+(?:\$|€|£|usd|eur)?\s?\d[\d,.]*\s*(?:\$|€|£|usd|eur|dollars|euros|btc)?\s+to\b
        |\b(?:delete|erase|wipe|remove|drop|destroy)\s+(?:all|every|the\s+entire|the\s+whole)\s+\w+
        |\brm\s+-rf\b|\bcurl\s+[^|\n]{0,80}\|\s*(?:ba)?sh\b|\b(?:grant|give)\s+(?:admin|root|full)\s+access\b
        |\b(?:issue|process|make)\s+(?:a\s+)?(?:full\s+)?refund\b
        |\bdisable\s+(?:the\s+)?(?:safety|security|two-factor|2fa|mfa|filter|guardrails?|moderation|content\s+polic)
        |\bterraform\s+destroy\b|\bdrop\s+(?:database|table)\b|-auto-approve\b|--force\b|\bcreate\s+(?:a\s+)?new\s+payee
        |\bschedule\s+a\s+payment\b"""),
    # -- exfiltration
    rule("markdown_beacon", "exfiltration", 1.0, "~![ ~<img ~](", rf"""
        (?:!?\[[^\]]{{0,100}}\]\(\s*|<img\s[^>]{{0,80}}src\s*=\s*["']?)https?://[^)\s"']*[?&#][^)\s"']*
        (?:\{{|%7b|<|\[|\$|=[^&)\s"']{{0,20}}?{_SECRET}|=\.\.\.|=["')]|=$)"""),
    rule("send_secrets", "exfiltration", 1.0,
         "send post upload forward transmit leak exfiltrate append include embed encode add put paste", rf"""
        \b(?:send|post|upload|forward|transmit|leak|exfiltrate|append|include|embed|encode|add|put|paste)\s+
        (?:[\w'-]+\s+){{0,5}}?{_SECRET}
        [^.\n]{{0,60}}?\b(?:to|into|in|at|via)\s+(?:the\s+)?(?:https?://|url|link|address|endpoint|server|webhook
        |image|query|parameter|[\w-]+=|[\w.+-]+@)"""),
    rule("url_carries_secret", "exfiltration", 1.0,
         "where with replace replacing containing filled fill filling using from followed appended", rf"""
        https?://[^\s)]*(?:[?&][\w-]+=[^\s)]*|/)[^.\n]{{0,120}}?\b(?:where|with|replace|replacing|containing|filled|fill
        |filling|using|from|followed\s+by|appended|append)\b
        [^.\n]{{0,60}}?{_SECRET}"""),
    rule("visit_url_with", "exfiltration", 0.5, "http https", r"""
        https?://[^\s)]*[?&](?:q|data|d|c|conv|chat|history|prompt|secret|key|token|session|info|payload)=
        (?:\{|%7b|<|\[|\$)"""),
    # -- addressed_to_model
    rule("note_to_model", "addressed_to_model", 1.0, MODEL_WORDS, rf"""
        \b(?:note|message|instructions?|attention|important|reminder|memo|notice|p\.?s\.?)\s+(?:to|for)\s+
        (?:any\s+|all\s+|the\s+)?{_MODEL}\b
        |\bif\s+you\s+are\s+(?:an?\s+)?(?:ai|a\.i\.|assistant|language\s+model|llm|chatbot|bot|agent|automated)
        |\b(?:dear|hey|hello|hi|attention|to\s+the)\s+(?:ai|assistant|chatbot|llm|gpt|language\s+model|agent|bot)\b
        |\b{_MODEL}\s+(?:reading|processing|summari[sz]ing|parsing|analy[sz]ing|seeing|that\s+reads?)\s+(?:this|these)
        |\b(?:for|to)\s+(?:the|any|all|an?|every|whichever|whatever)\s+{_MODEL}\b[^:.\n]{{0,40}}:
        |\b(?:whichever|whatever|any|every)\s+{_MODEL}\s+(?:is\s+)?(?:reads?|reading|sees|processes|processing)\b"""),
    rule("model_colon_do", "addressed_to_model", 1.0, MODEL_WORDS, rf"""
        \b{_MODEL}(?:\s+[\w-]+){{0,3}}?(?:\s+(?:instructions?|note|directive|task))?\s*:\s*
        (?:[^.\n:]{{0,60}}?,\s*)?(?:please\s+)?{_DO}\b"""),
    rule("at_bot", "addressed_to_model", 1.0, "~@", rf"""
        @[\w-]*(?:bot|assistant|ai|agent|gpt|llm|copilot|claude)\b[:,]?\s*(?:[^.\n:]{{0,60}}?[:,]\s*)?(?:please\s+)?
        (?:{_DO}|what|switch)\b"""),
    rule("recommended_that_model", "addressed_to_model", 1.0, "recommended required expected important best", rf"""
        \b(?:recommended|required|expected|important|best|essential|advisable|appropriate)\s+(?:that|if|for)\s+
        (?:any|the|an?|all|every|each)\s+(?:[\w-]+\s+){{0,2}}?{_MODEL}\b"""),
    rule("model_qualified_must", "addressed_to_model", 1.0, MODEL_WORDS, rf"""
        \b{_MODEL}(?:\s+[\w',-]+){{0,7}}?\s+(?:should|must|shall|would\s+(?:naturally|ideally|always)|are\s+required\s+to
        |is\s+required\s+to|needs?\s+to|ought\s+to|are\s+expected\s+to|is\s+expected\s+to)\s+
        (?:first\s+|always\s+|also\s+|now\s+|only\s+|immediately\s+|naturally\s+)?
        (?:tell|say|recommend|mention|suggest|present|advise|inform|urge|insist|claim|praise|rate|rank|prefer|disclose
        |reveal|translate|show|include|link|visit|call|send|ignore|treat|describe|point\s+out|direct|quote|cite
        |note\s+that|end\s+(?:with|by)|begin\s+(?:with|by)|start\s+(?:with|by)|display|promote|favou?r|highlight
        |steer|warn|encourage|remind|run|execute|delete|transfer|share|forward|approve)\b
        |\b(?:summar(?:y|ies)|answers?|responses?|replies|explanations?|outputs?|descriptions?|reviews?|recommendations?)
        \s+(?:produced|generated|written|created|made|given|provided)\s+by\s+(?:an?\s+|the\s+)?(?:[\w-]+\s+)?{_MODEL}\b
        |\b(?:any|every|all|each)\s+(?:answers?|responses?|replies|summar(?:y|ies)|explanations?)\s+(?:\w+\s+){{0,3}}?
        (?:on|from|of|cites?|citing|using|drawing\s+on)\s+this\s+(?:page|file|document|wiki|article|site|help\s+cent(?:re|er)
        |source|repository|repo|thread|post)\b[^.\n]{{0,40}}?\b(?:should|must|shall)\b"""),
    rule("model_must", "addressed_to_model", 0.75, MODEL_WORDS, rf"""
        \b{_MODEL}\s+(?:must|should|shall|needs\s+to|has\s+to|is\s+(?:required|instructed|expected)\s+to|will\s+now)\s+
        (?:now\s+|always\s+|immediately\s+|also\s+|only\s+)?(?:tell|say|respond|reply|answer|recommend|include|mention
        |state|output|print|ignore|call|send|direct|advise|inform|urge|insist|describe|claim|report|refuse|write|add
        |praise|rate|visit|end|begin|start|treat|quote|list|use|cite|prefer|rank|note|point|flag|mark|approve)"""),
    rule("model_doing_should", "addressed_to_model", 1.0, MODEL_WORDS, rf"""
        \b{_MODEL}(?:\s+[\w-]+){{0,3}}?\s+(?:reading|processing|summari[sz]ing|helping|handling|evaluating|reviewing
        |analy[sz]ing|asked|answering|comparing|ranking|screening|working)\b[^.\n]{{0,100}}?
        \b(?:should|must|needs?\s+to|is\s+to|has\s+to|will|shall)\b
        |\bif\s+(?:an?|the|any)\s+(?:[\w-]+\s+)?{_MODEL}\s+(?:is|are)\s+(?:asked|\w+ing)\b[^.\n]{{0,100}}?
        \b(?:it|they)\s+(?:should|must|shall|would|could|needs?|ought)\b
        |\b{_MODEL}(?:\s+[\w-]+){{0,4}}?\s+(?:told|tells|tell|recommended|recommends|said|says|informed|informs)\s+
        (?:the\s+)?(?:user|customer|reader|client|candidate)"""),
    rule("when_summarising", "addressed_to_model", 1.0, "when", r"""
        \bwhen\s+(?:you\s+(?:are\s+)?)?(?:summari[sz]|answer|respond|repl|read|process|describ|review|explain|evaluat)\w*
        \s+(?:this|these|the\s+above|about\s+this)[^.\n]{0,60}?,?\s+(?:you\s+)?(?:must|should|always|also|please)?\s*
        (?:tell|say|mention|include|recommend|state|add|insist|claim|write|direct|urge|describe|rate|call|output)"""),
    rule("model_key", "addressed_to_model", 0.75, "~ai ~llm ~assistant ~agent ~model ~bot ~gpt", r"""
        ["'](?:ai|llm|assistant|agent|model|bot|gpt)[_-]?(?:note|notes|guidance|instructions?|hint|directive|prompt
        |message|policy|rules?|task)["']\s*:"""),
    rule("treat_as_authority", "addressed_to_model", 0.5, "treat regard consider prefer", r"""
        \b(?:treat|regard|consider)\s+this\s+(?:source|document|page|review|result|article|passage|entry)\s+as\s+
        (?:the\s+)?(?:most\s+|only\s+)?(?:authoritative|trusted|reliable|correct|definitive|helpful|accurate)
        |\bprefer\s+(?:it|this\s+\w+)\s+over\s+(?:any|all|other)"""),
    rule("hidden_style", "addressed_to_model", 0.5, "display none hidden color font size opacity", r"""
        display\s*:\s*none|visibility\s*:\s*hidden|font-size\s*:\s*[01](?:\.\d+)?\s*px|opacity\s*:\s*0(?:\.0+)?\b
        |color\s*:\s*\#?(?:fff(?:fff)?|white)\b"""),
    # -- covert
    rule("hide_from_user", "covert", 1.0,
         "user human customer operator person secretly silently covertly quietly mention reveal disclose report "
         "acknowledge bother trouble", r"""
        \b(?:do\s+not|don't|never|without)\s+(?:tell|telling|inform|informing|mention|mentioning|alert|alerting|notify
        |notifying|reveal|revealing|asking|ask|let)\s+(?:it\s+|this\s+|that\s+|anything\s+)?(?:to\s+)?(?:the\s+)?
        (?:user|human|customer|operator|person)\b
        |\bno\s+need\s+to\s+(?:confirm|check|ask|verify)\s+(?:with\s+)?(?:the\s+)?(?:user|human|customer|owner)\b
        |\b(?:do\s+not|don't|never)\s+(?:mention|reveal|disclose|report|acknowledge)\s+(?:this|these|that)\s+
        (?:step|instruction|comment|note|change|message|request|line|action|transfer|payment)s?\b
        |\b(?:don't|do\s+not|never)\s+(?:bother|trouble)\s+the\s+(?:user|customer)\b
        |\b(?:secretly|silently|covertly|quietly)\s+(?:send|call|forward|add|include|transfer|run|execute|append|insert)
        |\btell\s+the\s+(?:user|customer)\s+(?:that\s+)?(?:their|the|nothing)\s+[\w\s]{0,20}?(?:is|was|were)\s+
        (?:unchanged|not\s+changed|changed)\b"""),
    rule("unconfirmed", "covert", 0.5, "without", r"""
        \bwithout\s+(?:any\s+|further\s+|human\s+)?(?:confirmation|confirming|asking|approval|verification|checking
        |review|question|questions|hesitation)\b"""),
    rule("user_authorised", "covert", 0.5, "authorized authorised approved consented agreed wants asked", r"""
        \b(?:the\s+)?(?:user|owner|customer|admin)\s+(?:has\s+)?(?:already\s+)?(?:authori[sz]ed|approved|consented|agreed
        |wants\s+you|asked\s+you)"""),
    # -- encoded
    rule("decode_and_do", "encoded", 1.0, "decode base64 rot13 rot url hex reverse reversed says", r"""
        \b(?:decode|url-decode|base64|rot-?13|hex|reverse|reversed)\b[^.\n]{0,40}?\b(?:and|then)\s+(?:execute|do|follow
        |run|obey|apply|act\s+on|carry\s+out|comply)\b|\b(?:do|follow|execute|obey)\s+what\s+it\s+says\b"""),
)

# Instructions in other languages: the override, role and leak rules, each a strong signal.
FOREIGN = (
    # French
    rule("fr", "instruction_override", 1.0,
         "ignore ignorer ignorez oublie oublier oubliez ne tu prompt nouvelles destiné destinée modèle", r"""
        \b(?:ignore[rz]?|oublie[rz]?|ne\s+tiens\s+pas\s+compte\s+d)\s+(?:toutes\s+|tous\s+)?(?:les\s+|tes\s+|vos\s+|des\s+)?
        (?:instructions?|consignes|r[eè]gles|directives|ordres)(?:\s+(?:pr[ée]c[ée]dentes|ant[ée]rieures|initiales))?
        |\bne\s+tiens?\s+(?:plus|pas)\s+compte\s+d[e']\s*(?:tes|vos|les|ces)?\s*(?:instructions|consignes|r[eè]gles)
        |\btu\s+es\s+(?:maintenant|d[ée]sormais)\b|\bprompt\s+(?:syst[eè]me|initial)\b|\bnouvelles\s+instructions\b
        |\b(?:destin[ée]e?\s+(?:au|à\s+l['a])\s*(?:mod[eè]le|ia|assistant)|mod[eè]le\s+de\s+langue)"""),
    # Spanish, Portuguese, Italian
    rule("es_pt_it", "instruction_override", 1.0,
         "ignora ignore ignorar olvida olvide esqueça esqueca esquece dimentica trascura desconsidere desconsidera "
         "desconsiderar ahora agora ora prompt mensaje mensagem messaggio", r"""
        \b(?:ignora|ignore|ignorar|olvida|olvide|esque[cç]a|esquece|dimentica|trascura|desconsider[ae]r?)\s+
        (?:todas\s+|todos\s+|tutte\s+)?(?:las\s+|los\s+|tus\s+|sus\s+|as\s+|os\s+|suas\s+|le\s+|tue\s+)?
        (?:instrucciones|instru[cç][oõ]es|istruzioni|reglas|regras|regole|indicaciones|[oó]rdenes)
        |\b(?:ahora\s+eres|agora\s+voc[eê]\s+[eé]|ora\s+sei|a\s+partir\s+de\s+ahora\s+eres)\b
        |\b(?:prompt|mensaje|mensagem|messaggio)\s+(?:del\s+|do\s+|di\s+)?sistema\b"""),
    # German, Dutch
    rule("de_nl", "instruction_override", 1.0,
         "ignoriere ignorieren ignoriert ignorier vergiss vergessen missachte negeer vergeet du system systemprompt "
         "prompt neue", r"""
        \b(?:ignorier(?:e|en|t)?|vergiss|vergessen\s+sie|missachte|negeer|vergeet)\s+(?:sie\s+)?(?:alle\s+|alles\s+)?
        (?:deine\s+|ihre\s+|die\s+|de\s+|je\s+)?(?:vorherigen\s+|bisherigen\s+|obigen\s+|vorigen\s+|eerdere\s+|vorige\s+)?
        (?:anweisungen|instruktionen|regeln|befehle|vorgaben|instructies|regels)
        |\bdu\s+bist\s+(?:jetzt|ab\s+sofort|nun)\b|\bsystem-?prompt\b|\bneue\s+anweisungen\b"""),
    # Russian
    rule("ru", "instruction_override", 1.0, "игнорируй игнорируйте забудь забудьте не проигнорируй ты ~системн", r"""
        (?:игнорируй|игнорируйте|забудь|забудьте|не\s+обращай\s+внимания\s+на|проигнорируй)\s+(?:все\s+)?
        (?:предыдущие\s+|прежние\s+|свои\s+|твои\s+|данные\s+)?(?:инструкции|указания|правила|команды)
        |\bты\s+теперь\b|системн\w+\s+(?:промпт|подсказк|инструкци)"""),
    # Chinese, Japanese, Korean (no word boundaries)
    rule("cjk", "instruction_override", 1.0,
         "~忽 ~无视 ~無視 ~忘 ~不要理会 ~不理会 ~你现在是 ~你現在是 ~从现在开始你 ~從現在開始你 "
         "~系统 ~系統 ~を無視 ~を忘れ ~システムプロンプト ~무시 ~잊 ~프롬프트", r"""
        (?:忽略|忽视|无视|無視|忘记|忘記|忘掉|不要理会|不理会)[^。\n]{0,8}(?:指令|指示|说明|說明|规则|規則|提示|要求|命令)
        |(?:你现在是|你現在是|从现在开始你|從現在開始你)|系统提示|系統提示|系统指令
        |(?:以前|前|上記|これまで|先ほど)の(?:指示|命令|ルール|指令)を[^。\n]{0,6}(?:無視|忘れ)|システムプロンプト
        |(?:이전|위의|앞의)\s*(?:지시|명령|지침)[^.\n]{0,6}(?:무시|잊)|시스템\s*프롬프트"""),
    # Turkish, Polish, Indonesian, Vietnamese, Ukrainian, Arabic, Hebrew, Hindi, Greek
    rule("other_scripts", "instruction_override", 1.0,
         "talimatları talimatlari zignoruj abaikan lupakan ігноруй ігноруйте забудь strunta ignorera glöm ignorer glem "
         "~bỏ qua ~تجاهل ~التعليمات "
         "~התעלם ~ההוראות ~अनदेखा ~निर्देश ~αγνόησε ~οδηγίες ~yapay", r"""
        talimatlar[ıi]\s+(?:unut|yok\s+say|g[öo]rmezden\s+gel)|yapay\s+zek[aâ]\s+asistan
        |\bzignoruj\s+(?:wszystkie\s+)?(?:poprzednie\s+)?(?:instrukcje|polecenia)
        |\b(?:abaikan|lupakan)\s+(?:semua\s+)?(?:instruksi|perintah|petunjuk)
        |bỏ\s+qua\s+(?:tất\s+cả\s+|mọi\s+)?(?:các\s+)?(?:hướng\s+dẫn|chỉ\s+dẫn|lệnh)
        |\b(?:strunta\s+i|ignorera|glöm|ignorer|glem)\s+(?:alla\s+|alle\s+)?(?:dina\s+|dine\s+|de\s+)?
        (?:tidigare\s+|tidligere\s+|forrige\s+)?(?:instruktioner|instruksjoner|instruktionerne|anvisningar|regler)
        |(?:ігноруй|ігноруйте|забудь)\s+(?:всі\s+)?(?:попередні\s+)?(?:інструкції|вказівки)
        |تجاهل[^.\n]{0,20}(?:التعليمات|الأوامر|التوجيهات)|התעלם[^.\n]{0,15}(?:ההוראות|מההוראות)
        |(?:निर्देशों|निर्देश)[^।\n]{0,20}अनदेखा|αγνόησε[^.\n]{0,20}(?:οδηγίες|εντολές)"""),
    # Addressed to the model, in other languages
    rule("addressed_foreign", "addressed_to_model", 1.0,
         "assistente asistente assistant ki ia ~ai ~アシスタント ~助手 ~ии ~المساعد ~trợ lý ~asistan ~assistent", r"""
        \b(?:assistente|asistente|assistant|ki-assistent|assistentin)\s+(?:de\s+|d'|di\s+)?(?:ia|ki)\b
        |\b(?:atenção|atención|attention|achtung|attenzione),?\s+(?:assistente|asistente|assistant|ki|ia)\b
        |ai(?:アシスタント|助手)(?:へ|に|：|:)|(?:读到|讀到|阅读)[^。\n]{0,10}(?:ai|助手)|ии-?ассистент
        |إلى\s+المساعد|trợ\s+lý\s+ai|\bai-?(?:assistent(?:en|in)?|asistan[ıi]?)\b|\btill\s+ai"""),
)
