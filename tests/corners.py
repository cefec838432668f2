"""Texts where a tokenizer of Bangla usually goes wrong, for every test that holds an outside
runtime's ids against `tokenizers`' (onnxruntime-genai, transformers 5.x): the marks a
GPT-2-style split cuts at, nukta forms both composed and not, the joiners, digits, dandas, byte
fallback (emoji, CJK), and whitespace at the edges."""

CORNERS = [
    "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।",
    "কি কী কু কূ কৃ কে কৈ কো কৌ কং কঃ কঁ",  # vowel signs and the other marks
    "ক্ষ জ্ঞ স্ত্র ন্ত্র ক্‌",  # virama: conjuncts and an explicit one
    "ড় ঢ় য় ড\u09bc ঢ\u09bc য\u09bc \u09dc \u09dd \u09df",  # nukta forms, NFC and decomposed
    "র\u200d্যাব কি\u200cন্তু \u200c\u200d",  # ZWJ / ZWNJ
    "১২৩৪৫ ০.৫ ১,০০০ 12345 3.14",  # Bengali and ASCII digits
    "এল। গেল।। শেষ॥ ?!",  # dandas
    "😀👍🏽 ❤️ 🇧🇩",  # emoji (byte fallback, several tokens a character)
    "中文字 日本語 한국어",  # CJK
    "a\tb\t\tc",  # tabs
    "a    b     c",  # runs of spaces
    " x",  # a leading space
    "  lead",
    "line1\nline2\n\nline3\n",  # newlines
    "\n",
    " ",
    "",
]
